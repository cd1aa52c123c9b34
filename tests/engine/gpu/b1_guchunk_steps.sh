# Session 12's gq candidate call (STRATA_GPU_GU_CHUNK; tests/engine/gpu/b1_guchunk_candidate.patch, against 4958abb), run
# on the GPU machine after device_run.sh's setup (b1_call.sh does it). Its library /tmp/l/guchunk.so comes gzipped in the
# carried .b1/ (sm_90, built from `git archive 4958abb` + the patch); without it (or with GQ_REBUILD=1, e.g. when HEAD's
# CUDA sources moved since 4958abb) this script builds it from the patched copy below (sm_90, ~60-120 s on 16 cores).
# Call (carry .whl and .b1):
#   CAND=guchunk STEPS='bash tests/engine/gpu/b1_guchunk_steps.sh' bash tests/engine/gpu/b1_call.sh
# Warm machine, ~150-200 s:
# 1. from a patched copy of the tree (its header declares the new harness entry): test_gpu_b1_knobs.py whole (with
#    test_gu_chunk_bitwise and test_gu_chunk_decode_steps_bitwise), test_gpu_kernels.py -k "routed or swiglu";
#    test_gpu_models.py with STRATA_GPU_GU_CHUNK=1 and =3 (smoke: nothing else moved);
# 2. knob_bitwise STRATA_GPU_GU_CHUNK 0 vs 1 / 2 / 3 at 1, 2 and 4 sequences on the bench model;
# 3. one --decode-only --lean process: batch-1 rows of each form between default rows, twice (repeats spelled 01 / 02 /
#    03 so that the rows do not overwrite each other), and 4-sequence rows (the form applies at 1-7 tokens);
# 4. (GQ_PROFILE=1, ~40 s each) --profile-decode with GU_CHUNK 0 and with the best form (GQ_FORM, default 1): the
#    gate/up kernel's time against k_linear_q<12,1,1> + k_quant_act (graphs and PDL off).
set -u
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
L=${L:-/tmp/l}; OUT=${OUT:-/tmp/out}; mkdir -p "$L" "$OUT"
C=$L/guchunk.so
P=tests/engine/gpu/b1_guchunk_candidate.patch
T=/tmp/gqtree  # the patched copy: the library's sources when it is rebuilt, and the patched tests and header
rm -rf $T && mkdir -p $T && cp -r engine tests bench pyproject.toml $T/ 2>/dev/null
patch -d $T -p1 -N -s --no-backup-if-mismatch < $P > $OUT/gq_patch.log 2>&1
el "patch exit $? (tail: $(tail -1 $OUT/gq_patch.log))"
if [ ! -f "$C" ] || [ "${GQ_REBUILD:-0}" = 1 ]; then
  (cd $T && PYTHONPATH=/tmp/site:$T python3 -m engine._build_cuda --sm90-out "$C") > $OUT/gq_build.log 2>&1
  el "candidate build exit $?: $(tail -1 $OUT/gq_build.log)"
fi
(python3 -m bench.engine_gpu --build-only > /tmp/model-build.log 2>&1) &
(cd $T && PYTHONPATH=/tmp/site:$T STRATA_CUDA_LIB=$C timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
  tests/engine/gpu/test_gpu_b1_knobs.py tests/engine/gpu/test_gpu_kernels.py -k "gu_chunk or routed or swiglu or q6k or attention") \
  > $OUT/gq_tests.log 2>&1
el "candidate tests exit $?: $(tail -1 $OUT/gq_tests.log)"; grep -E '^(FAILED|ERROR)' $OUT/gq_tests.log | head
for v in 1 3; do
  (cd $T && PYTHONPATH=/tmp/site:$T STRATA_GPU_GU_CHUNK=$v STRATA_CUDA_LIB=$C timeout 80 python3 -m pytest -q \
    -p no:cacheprovider -o addopts="" tests/engine/gpu/test_gpu_models.py) >> $OUT/gq_tests.log 2>&1
  el "model tests (GU_CHUNK=$v) exit $?: $(tail -1 $OUT/gq_tests.log)"; grep -E '^(FAILED|ERROR)' $OUT/gq_tests.log | head
done
wait; el "model: $(tail -1 /tmp/model-build.log)"
STRATA_CUDA_LIB=$C timeout 90 python3 tests/engine/gpu/knob_bitwise.py STRATA_GPU_GU_CHUNK --values 0,1,2,3 \
  --seqs 1,2,4 --steps 3 2>&1 | grep -E "sequences|rror|differ" | tee -a $OUT/gq_tests.log; el kb
STRATA_CUDA_LIB=$C timeout 150 python3 -m bench.engine_gpu --decode-only --lean --knob 1:STRATA_GPU_NONE=1 \
  --knob 1:STRATA_GPU_GU_CHUNK=1 --knob 1:STRATA_GPU_GU_CHUNK=2 --knob 1:STRATA_GPU_GU_CHUNK=3 --knob 1:STRATA_GPU_NONE=2 \
  --knob 1:STRATA_GPU_GU_CHUNK=03 --knob 1:STRATA_GPU_GU_CHUNK=02 --knob 1:STRATA_GPU_GU_CHUNK=01 \
  --knob 1:STRATA_GPU_NONE=3 --knob 4:STRATA_GPU_NONE=4 --knob 4:STRATA_GPU_GU_CHUNK=1 --knob 4:STRATA_GPU_GU_CHUNK=3 \
  > $OUT/gq_bench.log 2>&1
el "bench exit $?"; grep -E '^decode \(|rror' $OUT/gq_bench.log
[ "${GQ_PROFILE:-0}" = 1 ] || exit 0
for v in 0 "${GQ_FORM:-1}"; do
  STRATA_GPU_GU_CHUNK=$v STRATA_CUDA_LIB=$C timeout 120 python3 -m bench.engine_gpu --profile-decode --decode-only --lean \
    --knob 1:STRATA_GPU_NONE=1 > $OUT/gq_profile_$v.log 2>&1
  el "profile GU_CHUNK=$v exit $?"; grep -E '^== |k_linear_q|k_quant_act|Self CUDA time total' $OUT/gq_profile_$v.log | head -16
done
