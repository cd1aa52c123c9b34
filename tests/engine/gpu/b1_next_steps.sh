# Session 12's batch-1 candidate call (prepared in session 11 by nb1, NOT run; docs/gpu-runs.md "Prepared for session
# 12: batch-1 candidates (nb1)"), run on the GPU machine after device_run.sh's setup. The candidate is
# tests/engine/gpu/b1_next_candidate.patch (against 4292b4b): STRATA_GPU_Q6_HEAD 1 / 2 / 3, the output head's Q6_K
# matvec at batch 1 on k_q6_stage (each warp's 2 / 4 / 2 rows copied into shared memory by 16-byte cp.async, then
# Q6_ROWS' loop on the copy; 3 issues the copy before the wait), default 0, same bits. Its library /tmp/l/nb1q6h.so
# comes gzipped in the carried .b1/ (sm_90, built here from 4292b4b + the patch); without it (or with NB1_REBUILD=1,
# e.g. when HEAD's CUDA sources moved since 4292b4b) this script applies the patch to a copy of the device tree and
# builds it there (sm_90, ~60-120 s on 16 cores).
# Run it with b1_call.sh (carry .whl and .b1):
#   CAND=nb1q6h STEPS='bash tests/engine/gpu/b1_next_steps.sh' bash tests/engine/gpu/b1_call.sh
# or after any other wrapper's device_run.sh setup as `bash tests/engine/gpu/b1_next_steps.sh` (L, OUT set).
# Warm machine, ~120-150 s with the prebuilt library:
# 1. the candidate's tests (test_gpu_b1_knobs.py's Q6_K tests with the new test_q6k_head_stage_bitwise, the Q6_K
#    kernel tests) and test_gpu_models.py with STRATA_GPU_Q6_HEAD=2 (the models' heads are too small to take it:
#    a smoke check that nothing else moved);
# 2. knob_bitwise STRATA_GPU_Q6_HEAD 0 vs 1 / 2 / 3 at 1 and 2 sequences on the bench model (logits: the head's
#    output itself);
# 3. one --decode-only --lean process: batch-1 rows of each mode against default rows of the same process, twice
#    (the repeats spelled =01 / =02 / =03 so that the rows do not overwrite each other);
# 4. (if the budget allows; each ~25 s) Nsight Compute of the head alone: the default form (the step's last
#    k_linear_q_rows<114, 2>: Q6_ROWS' wide Q6_K form) and k_q6_stage at 1 (L1 / shared wavefronts,
#    DRAM throughput: the patch's reasoning is that the default head is bound by the L1's data path, not DRAM).
set -u
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
L=${L:-/tmp/l}; OUT=${OUT:-/tmp/out}; mkdir -p "$L" "$OUT"
C=$L/nb1q6h.so
P=tests/engine/gpu/b1_next_candidate.patch
T=/tmp/nb1tree  # a patched copy: the library's sources when it is rebuilt, and the patched test file
rm -rf $T && mkdir -p $T && cp -r engine tests bench pyproject.toml $T/ 2>/dev/null
patch -d $T -p1 -N -s --no-backup-if-mismatch < $P > $OUT/nb1_patch.log 2>&1
el "patch exit $? (tail: $(tail -1 $OUT/nb1_patch.log))"
if [ ! -f "$C" ] || [ "${NB1_REBUILD:-0}" = 1 ]; then
  (cd $T && PYTHONPATH=/tmp/site:$T python3 -m engine._build_cuda --sm90-out "$C") > $OUT/nb1_build.log 2>&1
  el "candidate build exit $?: $(tail -1 $OUT/nb1_build.log)"
fi
(python3 -m bench.engine_gpu --build-only > /tmp/model-build.log 2>&1) &
K=tests/engine/gpu/test_gpu_b1_knobs_nb1.py  # the patched test file beside HEAD's (removed below)
cp $T/tests/engine/gpu/test_gpu_b1_knobs.py $K
STRATA_CUDA_LIB=$C timeout 90 python3 -m pytest -q -p no:cacheprovider -o addopts="" $K \
  tests/engine/gpu/test_gpu_kernels.py -k "q6k or Q6_K" > $OUT/nb1_tests.log 2>&1
el "candidate Q6_K tests exit $?: $(tail -1 $OUT/nb1_tests.log)"; grep -E '^(FAILED|ERROR)' $OUT/nb1_tests.log | head
rm -f $K
STRATA_GPU_Q6_HEAD=2 STRATA_CUDA_LIB=$C timeout 60 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
  tests/engine/gpu/test_gpu_models.py >> $OUT/nb1_tests.log 2>&1
el "model tests (Q6_HEAD=2) exit $?: $(tail -1 $OUT/nb1_tests.log)"; grep -E '^(FAILED|ERROR)' $OUT/nb1_tests.log | head
wait; el "model: $(tail -1 /tmp/model-build.log)"
STRATA_CUDA_LIB=$C timeout 60 python3 tests/engine/gpu/knob_bitwise.py STRATA_GPU_Q6_HEAD --values 0,1,2,3 \
  --seqs 1,2 --steps 3 2>&1 | grep -E "sequences|rror|differ" | tee -a $OUT/nb1_tests.log; el kb
STRATA_CUDA_LIB=$C timeout 100 python3 -m bench.engine_gpu --decode-only --lean --knob 1:STRATA_GPU_NONE=1 \
  --knob 1:STRATA_GPU_Q6_HEAD=1 --knob 1:STRATA_GPU_Q6_HEAD=2 --knob 1:STRATA_GPU_Q6_HEAD=3 --knob 1:STRATA_GPU_NONE=2 \
  --knob 1:STRATA_GPU_Q6_HEAD=03 --knob 1:STRATA_GPU_Q6_HEAD=02 --knob 1:STRATA_GPU_Q6_HEAD=01 \
  --knob 1:STRATA_GPU_NONE=3 --knob 1:STRATA_GPU_Q6_ROWS=0 > $OUT/nb1_bench.log 2>&1
el "bench exit $?"; grep -E '^decode \(|rror' $OUT/nb1_bench.log
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "no ncu"; exit 0; }
STRATA_GPU_PDL=0 STRATA_GPU_GRAPHS=0 STRATA_CUDA_LIB=$C timeout 45 "$NCU" --clock-control none --profile-from-start off \
  --kernel-name-base demangled -k 'regex:k_linear_q_rows<114' --launch-count 1 --section SpeedOfLight --section LaunchStats \
  --section Occupancy --section MemoryWorkloadAnalysis python3 -m bench.engine_gpu --ncu-step 1 > $OUT/nb1_ncu.txt 2>&1
el "ncu default head exit $?"
STRATA_GPU_Q6_HEAD=1 STRATA_GPU_PDL=0 STRATA_GPU_GRAPHS=0 STRATA_CUDA_LIB=$C timeout 45 "$NCU" --clock-control none \
  --profile-from-start off -k regex:k_q6_stage --launch-count 1 --section SpeedOfLight --section LaunchStats \
  --section Occupancy --section MemoryWorkloadAnalysis python3 -m bench.engine_gpu --ncu-step 1 >> $OUT/nb1_ncu.txt 2>&1
el "ncu Q6_HEAD=1 exit $?"
grep -E '^  void|^  k_|Duration|DRAM Throughput|Memory Throughput|L1/TEX Cache Throughput|L2 Cache Throughput|Mem Pipes Busy|Grid Size|Registers Per Thread  |Achieved Occupancy|Shared Memory Configuration Size' \
  $OUT/nb1_ncu.txt
