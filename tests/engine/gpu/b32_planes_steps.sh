# The next 32-sequence call (session 11's b32 engineer, prepared after run 67 (b32); docs/gpu-runs.md run 67's "next
# 32-sequence call, prepared"), run on the GPU machine after device_run.sh's setup. Libraries in /tmp/l: head11 (HEAD
# b8e5f2a's sm_90 build) as engine/_strata_cuda.so, cand12 = b8e5f2a + tests/engine/gpu/b32_router_candidate.patch +
# b32_planes_candidate.patch (sm_90, `python3 -m engine._build_cuda --sm90-out`), the device tree holding cand12's
# sources and test_gpu_kernels.py (the harness entry stg_test_routed_quant is declared in its header). Warm ~200 s:
# 1. cand12's kernel, prefill-GEMM and model tests (the planes change every Q4_K GEMM form: bitwise == matvec rows);
# 2. --decode-only --lean of HEAD, of cand12 (B32 bits 3 / 4 / 3+4 / 1 / 1+3+4 at 32, 1+3+4 at 24 and 16), of HEAD
#    again (process order noise);
# 3. knob_bitwise STRATA_GPU_B32 0 vs 26 at 16 / 24 / 32 sequences with cand12;
# 4. Nsight Compute of cand12's layer 0 at 32 sequences (compare run 67's ncuA.txt: gate/up 63.1, down 43.4, q/k/v
#    29.6, o 21.7 us; LSU data-pipe wavefronts 29.7% in gate/up), then its o / q/k/v with B32 = 24.
set -u
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
C=/tmp/l/cand12.so
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
(python3 -m bench.engine_gpu --build-only > /tmp/model-build.log 2>&1) &
STRATA_CUDA_LIB=$C timeout 100 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/engine/gpu/test_gpu_kernels.py \
  tests/engine/gpu/test_gpu_gemm_prefill.py tests/engine/gpu/test_gpu_models.py > $OUT/checks.log 2>&1
el "cand12 tests exit $?: $(tail -1 $OUT/checks.log)"; grep -E '^(FAILED|ERROR)' $OUT/checks.log | head
wait; el "model: $(tail -1 /tmp/model-build.log)"
H='--knob 24:STRATA_GPU_NONE=1 --knob 16:STRATA_GPU_NONE=1'
timeout 60 python3 -m bench.engine_gpu --decode-only --lean $H > $OUT/bench.log 2>&1; el "bench HEAD exit $?"
STRATA_CUDA_LIB=$C timeout 100 python3 -m bench.engine_gpu --decode-only --lean --knob 32:STRATA_GPU_B32=8 \
  --knob 32:STRATA_GPU_B32=16 --knob 32:STRATA_GPU_B32=24 --knob 32:STRATA_GPU_NONE=1 --knob 32:STRATA_GPU_B32=2 \
  --knob 32:STRATA_GPU_B32=26 $H --knob 24:STRATA_GPU_B32=26 --knob 16:STRATA_GPU_B32=26 >> $OUT/bench.log 2>&1
el "bench cand12 exit $?"
timeout 60 python3 -m bench.engine_gpu --decode-only --lean $H >> $OUT/bench.log 2>&1; el "bench HEAD again exit $?"
grep -E '^decode \(|rror' $OUT/bench.log
STRATA_CUDA_LIB=$C timeout 60 python3 tests/engine/gpu/knob_bitwise.py STRATA_GPU_B32 --values 0,26 --seqs 16,24,32 2>&1 \
  | grep -E "sequences|rror|differ" | tee -a $OUT/checks.log; el kb
[ -n "$NCU" ] || { echo "no ncu"; exit 0; }
export STRATA_GPU_PDL=0 STRATA_GPU_GRAPHS=0 STRATA_CUDA_LIB=$C
S=(--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis)
timeout 60 "$NCU" --clock-control none --profile-from-start off -k 'regex:k_linear|k_rmsnorm|k_attention|k_route|k_quant' \
  --launch-count 11 "${S[@]}" -o /tmp/a python3 -m bench.engine_gpu --ncu-step 32 > /tmp/a.log 2>&1; el "ncu cand12 exit $?"
"$NCU" --import /tmp/a.ncu-rep --print-details all > $OUT/ncu12.txt 2>&1 || "$NCU" --import /tmp/a.ncu-rep > $OUT/ncu12.txt 2>&1
"$NCU" --import /tmp/a.ncu-rep --page raw --csv 2>&1 | gzip > $OUT/ncu12_raw.csv.gz
grep -E '^  [a-z_]+<|^  k_|^  void|Duration|L1: Data Pipe Lsu Wavefronts|Achieved Active Warps' $OUT/ncu12.txt | head -60
STRATA_GPU_B32=24 timeout 40 "$NCU" --clock-control none --profile-from-start off -k 'regex:k_linear_gemm' --launch-count 2 \
  --section SpeedOfLight --section LaunchStats python3 -m bench.engine_gpu --ncu-step 32 > $OUT/ncu12_narrow.txt 2>&1
el "ncu narrow exit $?"; grep -E '^  void|Duration|Grid Size|Waves' $OUT/ncu12_narrow.txt
