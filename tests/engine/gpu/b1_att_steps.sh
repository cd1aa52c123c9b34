# Session 12's at candidate call (STRATA_GPU_ATT_B1; tests/engine/gpu/b1_att_candidate.patch, against 4958abb), run on
# the GPU machine after device_run.sh's setup (b1_call.sh does it). Its library /tmp/l/attb1.so comes gzipped in the
# carried .b1/ (sm_90, built from `git archive 4958abb` + the patch); without it (or with AT_REBUILD=1, e.g. when HEAD's
# CUDA sources moved since 4958abb) this script builds it from the patched copy below (sm_90, ~60-120 s on 16 cores).
# Call (carry .whl and .b1):
#   CAND=attb1 STEPS='bash tests/engine/gpu/b1_att_steps.sh' bash tests/engine/gpu/b1_call.sh
# Warm machine, ~150-200 s:
# 1. from a patched copy of the tree: test_gpu_att_b1.py (whole decode steps of a Q8_0 Qwen3-MoE with head_dim 128 at
#    1 / 2 / 16 sequences, prompts of 20 and 70 tokens, ATT_PRE on and off: ATT_B1 1 / 2 / 3 bitwise 0), the attention
#    tests of test_gpu_b1_knobs.py and test_gpu_kernels.py; test_gpu_models.py with STRATA_GPU_ATT_B1=3 (smoke);
# 2. knob_bitwise STRATA_GPU_ATT_B1 0 vs 1 / 2 / 3 at 1, 2 and 16 sequences on the bench model;
# 3. one --decode-only --lean process: batch-1 rows of each form between default rows, twice (repeats spelled 01 / 02 /
#    03 so that the rows do not overwrite each other), and 8-sequence rows (the form applies to every fused decode step);
# 4. (AT_PROFILE=1, ~40 s each) --profile-decode with ATT_B1 0 and AT_FORM (default 3): k_attention<1, 128, *>'s time
#    (graphs and PDL off: there the pre-wait reads are on the chain, so only the prep's own shortening shows).
set -u
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
L=${L:-/tmp/l}; OUT=${OUT:-/tmp/out}; mkdir -p "$L" "$OUT"
C=$L/attb1.so
P=tests/engine/gpu/b1_att_candidate.patch
T=/tmp/attree  # the patched copy: the library's sources when it is rebuilt, and the new test file
rm -rf $T && mkdir -p $T && cp -r engine tests bench pyproject.toml $T/ 2>/dev/null
patch -d $T -p1 -N -s --no-backup-if-mismatch < $P > $OUT/at_patch.log 2>&1
el "patch exit $? (tail: $(tail -1 $OUT/at_patch.log))"
if [ ! -f "$C" ] || [ "${AT_REBUILD:-0}" = 1 ]; then
  (cd $T && PYTHONPATH=/tmp/site:$T python3 -m engine._build_cuda --sm90-out "$C") > $OUT/at_build.log 2>&1
  el "candidate build exit $?: $(tail -1 $OUT/at_build.log)"
fi
(python3 -m bench.engine_gpu --build-only > /tmp/model-build.log 2>&1) &
(cd $T && PYTHONPATH=/tmp/site:$T STRATA_CUDA_LIB=$C timeout 180 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
  tests/engine/gpu/test_gpu_att_b1.py tests/engine/gpu/test_gpu_b1_knobs.py tests/engine/gpu/test_gpu_kernels.py \
  -k "att_b1 or attention") > $OUT/at_tests.log 2>&1
el "candidate tests exit $?: $(tail -1 $OUT/at_tests.log)"; grep -E '^(FAILED|ERROR)' $OUT/at_tests.log | head
(cd $T && PYTHONPATH=/tmp/site:$T STRATA_GPU_ATT_B1=3 STRATA_CUDA_LIB=$C timeout 80 python3 -m pytest -q \
  -p no:cacheprovider -o addopts="" tests/engine/gpu/test_gpu_models.py) >> $OUT/at_tests.log 2>&1
el "model tests (ATT_B1=3) exit $?: $(tail -1 $OUT/at_tests.log)"; grep -E '^(FAILED|ERROR)' $OUT/at_tests.log | head
wait; el "model: $(tail -1 /tmp/model-build.log)"
STRATA_CUDA_LIB=$C timeout 120 python3 tests/engine/gpu/knob_bitwise.py STRATA_GPU_ATT_B1 --values 0,1,2,3 \
  --seqs 1,2,16 --steps 4 2>&1 | grep -E "sequences|rror|differ" | tee -a $OUT/at_tests.log; el kb
STRATA_CUDA_LIB=$C timeout 150 python3 -m bench.engine_gpu --decode-only --lean --knob 1:STRATA_GPU_NONE=1 \
  --knob 1:STRATA_GPU_ATT_B1=1 --knob 1:STRATA_GPU_ATT_B1=2 --knob 1:STRATA_GPU_ATT_B1=3 --knob 1:STRATA_GPU_NONE=2 \
  --knob 1:STRATA_GPU_ATT_B1=03 --knob 1:STRATA_GPU_ATT_B1=02 --knob 1:STRATA_GPU_ATT_B1=01 \
  --knob 1:STRATA_GPU_NONE=3 --knob 8:STRATA_GPU_NONE=4 --knob 8:STRATA_GPU_ATT_B1=2 --knob 8:STRATA_GPU_ATT_B1=3 \
  > $OUT/at_bench.log 2>&1
el "bench exit $?"; grep -E '^decode \(|rror' $OUT/at_bench.log
[ "${AT_PROFILE:-0}" = 1 ] || exit 0
for v in 0 "${AT_FORM:-3}"; do
  STRATA_GPU_ATT_B1=$v STRATA_CUDA_LIB=$C timeout 120 python3 -m bench.engine_gpu --profile-decode --decode-only --lean \
    --knob 1:STRATA_GPU_NONE=1 > $OUT/at_profile_$v.log 2>&1
  el "profile ATT_B1=$v exit $?"; grep -E '^== |k_attention|Self CUDA time total' $OUT/at_profile_$v.log | head -16
done
