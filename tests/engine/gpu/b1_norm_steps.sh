# Session 12's k_rmsnorm candidate call (nm; prepared, not run): tests/engine/gpu/b1_norm_candidate.patch
# (STRATA_GPU_NORM_FAST 1 / 2 / 3, default 0 = HEAD's k_rmsnorm; same bits by construction). Its library
# normfast.so comes gzipped in the carried .b1/ (sm_90, built from HEAD 4958abb + the patch); NM_REBUILD=1 (or no
# library) applies the patch to a copy of the device tree and builds it there (~60-120 s on 16 cores).
# Run it with b1_call.sh (carry .whl and .b1):
#   CAND=normfast STEPS='bash tests/engine/gpu/b1_norm_steps.sh' bash tests/engine/gpu/b1_call.sh
# Warm machine, ~110-140 s:
# 1. the candidate's test file (test_gpu_norm_fast.py: kernel-level bitwise vs k_rmsnorm at 576 / 1,536 / 2,048,
#    1 / 3 / 8 rows, no / 4 / 8 pending expert outputs, rows next to the scale's float midpoints; whole decode steps
#    of a small Qwen3-MoE), test_gpu_kernels.py's rmsnorm test and test_gpu_models.py with NORM_FAST=1;
# 2. knob_bitwise STRATA_GPU_NORM_FAST 0 vs 1 / 2 / 3 at 1, 2 and 8 sequences on the bench model;
# 3. one --decode-only --lean process: batch-1 rows of each value against default rows of the same process, twice.
set -u
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
L=${L:-/tmp/l}; OUT=${OUT:-/tmp/out}; mkdir -p "$L" "$OUT"
C=$L/normfast.so
P=tests/engine/gpu/b1_norm_candidate.patch
T=/tmp/nmtree  # a patched copy: the library's sources when it is rebuilt, and the candidate's test file
rm -rf $T && mkdir -p $T && cp -r engine tests bench pyproject.toml $T/ 2>/dev/null
patch -d $T -p1 -N -s --no-backup-if-mismatch < $P > $OUT/nm_patch.log 2>&1
el "patch exit $? (tail: $(tail -1 $OUT/nm_patch.log))"
if [ ! -f "$C" ] || [ "${NM_REBUILD:-0}" = 1 ]; then
  (cd $T && PYTHONPATH=/tmp/site:$T python3 -m engine._build_cuda --sm90-out "$C") > $OUT/nm_build.log 2>&1
  el "candidate build exit $?: $(tail -1 $OUT/nm_build.log)"
fi
(python3 -m bench.engine_gpu --build-only > /tmp/model-build.log 2>&1) &
K=tests/engine/gpu/test_gpu_norm_fast.py  # the candidate's test file (removed below; HEAD has none)
cp $T/$K $K
STRATA_CUDA_LIB=$C timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts="" $K \
  tests/engine/gpu/test_gpu_kernels.py -k "norm" > $OUT/nm_tests.log 2>&1
el "candidate tests exit $?: $(tail -1 $OUT/nm_tests.log)"; grep -E '^(FAILED|ERROR)' $OUT/nm_tests.log | head
rm -f $K
STRATA_GPU_NORM_FAST=1 STRATA_CUDA_LIB=$C timeout 60 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
  tests/engine/gpu/test_gpu_models.py >> $OUT/nm_tests.log 2>&1
el "model tests (NORM_FAST=1) exit $?: $(tail -1 $OUT/nm_tests.log)"; grep -E '^(FAILED|ERROR)' $OUT/nm_tests.log | head
wait; el "model: $(tail -1 /tmp/model-build.log)"
STRATA_CUDA_LIB=$C timeout 90 python3 tests/engine/gpu/knob_bitwise.py STRATA_GPU_NORM_FAST --values 0,1,2,3 \
  --seqs 1,2,8 --steps 3 2>&1 | grep -E "sequences|rror|differ" | tee -a $OUT/nm_tests.log; el kb
STRATA_CUDA_LIB=$C timeout 100 python3 -m bench.engine_gpu --decode-only --lean --knob 1:STRATA_GPU_NONE=1 \
  --knob 1:STRATA_GPU_NORM_FAST=1 --knob 1:STRATA_GPU_NORM_FAST=2 --knob 1:STRATA_GPU_NORM_FAST=3 \
  --knob 1:STRATA_GPU_NONE=2 --knob 1:STRATA_GPU_NORM_FAST=03 --knob 1:STRATA_GPU_NORM_FAST=02 \
  --knob 1:STRATA_GPU_NORM_FAST=01 --knob 1:STRATA_GPU_NONE=3 > $OUT/nm_bench.log 2>&1
el "bench exit $?"; grep -E '^decode \(|rror' $OUT/nm_bench.log
