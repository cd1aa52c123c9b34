# The next 32-sequence call (session 11's b32 engineer, prepared after run 67 (b32); docs/gpu-runs.md run 67's "next
# 32-sequence call, prepared"), run on the GPU machine after device_run.sh's setup. /tmp/l/cand13.so = b8e5f2a +
# tests/engine/gpu/b32_router_candidate.patch + b32_next_candidate.patch (sm_90, `python3 -m engine._build_cuda
# --sm90-out`); the device tree holds b8e5f2a's engine / tests / bench with cand13's CUDA sources, header and
# test_gpu_kernels.py over them. STRATA_GPU_B32 bits: 2 routing over blocks, 8 / 16 split o / q/k/v on 16-pair tiles,
# 32 the router's loads in flight; 58 = all four. Warm ~160 s:
# 1. cand13's kernel tests (routed / router / split-GEMM rows) and model tests with STRATA_GPU_B32=58;
# 2. two --decode-only --lean processes of cand13, rows in two orders, each bit against default rows of the same
#    process at 32, 24 and 16 sequences;
# 3. knob_bitwise STRATA_GPU_B32 0 vs 58 at 16 / 24 / 32 sequences;
# 4. Nsight Compute of layer 0's q/k/v, o, router and gate/up at 32 sequences with B32 = 56 (run 67: 29.6 / 21.7 /
#    13.8 / 63.1 us).
set -u
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
C=/tmp/l/cand13.so
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
(python3 -m bench.engine_gpu --build-only > /tmp/model-build.log 2>&1) &
STRATA_CUDA_LIB=$C timeout 60 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/engine/gpu/test_gpu_kernels.py \
  -k "routed or router or swiglu or gemm_bitwise or qkv_segments" > $OUT/checks.log 2>&1
el "cand13 kernel tests exit $?: $(tail -1 $OUT/checks.log)"
STRATA_GPU_B32=58 STRATA_CUDA_LIB=$C timeout 60 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
  tests/engine/gpu/test_gpu_models.py >> $OUT/checks.log 2>&1
el "cand13 model tests (B32=58) exit $?: $(tail -1 $OUT/checks.log)"; grep -E '^(FAILED|ERROR)' $OUT/checks.log | head
wait; el "model: $(tail -1 /tmp/model-build.log)"
STRATA_CUDA_LIB=$C timeout 100 python3 -m bench.engine_gpu --decode-only --lean --knob 32:STRATA_GPU_B32=8 \
  --knob 32:STRATA_GPU_NONE=1 --knob 32:STRATA_GPU_B32=32 --knob 32:STRATA_GPU_B32=24 --knob 32:STRATA_GPU_NONE=2 \
  --knob 32:STRATA_GPU_B32=2 --knob 32:STRATA_GPU_B32=58 --knob 32:STRATA_GPU_B32=40 --knob 24:STRATA_GPU_B32=40 \
  --knob 24:STRATA_GPU_NONE=1 --knob 24:STRATA_GPU_B32=2 --knob 24:STRATA_GPU_B32=32 --knob 16:STRATA_GPU_B32=2 \
  --knob 16:STRATA_GPU_NONE=1 --knob 16:STRATA_GPU_B32=32 > $OUT/bench.log 2>&1
el "bench 1 exit $?"
STRATA_CUDA_LIB=$C timeout 70 python3 -m bench.engine_gpu --decode-only --lean --knob 32:STRATA_GPU_B32=58 \
  --knob 32:STRATA_GPU_NONE=1 --knob 32:STRATA_GPU_B32=40 --knob 32:STRATA_GPU_B32=032 --knob 24:STRATA_GPU_B32=58 \
  --knob 24:STRATA_GPU_NONE=1 --knob 16:STRATA_GPU_B32=34 >> $OUT/bench.log 2>&1
el "bench 2 exit $?"; grep -E '^decode \(|rror' $OUT/bench.log
STRATA_CUDA_LIB=$C timeout 60 python3 tests/engine/gpu/knob_bitwise.py STRATA_GPU_B32 --values 0,58 --seqs 16,24,32 2>&1 \
  | grep -E "sequences|rror|differ" | tee -a $OUT/checks.log; el kb
[ -n "$NCU" ] || { echo "no ncu"; exit 0; }
STRATA_GPU_PDL=0 STRATA_GPU_GRAPHS=0 STRATA_CUDA_LIB=$C STRATA_GPU_B32=56 timeout 45 "$NCU" --clock-control none \
  --profile-from-start off -k 'regex:k_linear' --launch-count 4 --section SpeedOfLight --section LaunchStats \
  --section Occupancy --section WarpStateStats python3 -m bench.engine_gpu --ncu-step 32 > $OUT/ncu_next.txt 2>&1
el "ncu exit $?"; grep -E '^  void|Duration|Grid Size|Waves Per SM|Achieved Active Warps|Registers Per Thread  ' $OUT/ncu_next.txt
