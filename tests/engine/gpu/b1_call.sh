#!/usr/bin/env bash
# One batch-1 decode call on the GPU machine (session 9; docs/gpu-runs.md). Carry `.whl` and `.b1`
# (gzipped sm_90 libraries `.b1/NAME.so.gz`, an ignored folder so the tree stays under 64 MiB). CAND
# (default _strata_cuda_b1_1) becomes engine/_strata_cuda.so there (touched: device_run.sh does not
# rebuild it from the shared tree's sources); every library lands in /tmp/l/NAME.so. After
# device_run.sh's setup: the candidate's batch-1 switch tests, kernel and model tests, the switches'
# same-bits check on the bench model (knob_bitwise.py, every switch off / on / other values), then
# `bench.engine_gpu --decode-only --lean` of the candidate with every switch off (the forms before
# session 9) and at its defaults with one row per switch turned off (EXTRA_KNOBS: more `--knob N:ENV=V`
# rows). SWITCHES: the variables to turn off (default below); STEPS replaces those steps.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/l
cd "$(dirname "$0")/../../.." || exit 1
for f in .b1/*.so.gz; do gunzip -c "$f" > "/tmp/l/$(basename "$f" .gz)" || exit 1; done
CAND=${CAND:-_strata_cuda_b1_1}
cp "/tmp/l/$CAND.so" engine/_strata_cuda.so && touch engine/_strata_cuda.so || exit 1
export L=/tmp/l OUT CAND
# the batch-1 switches (strata_cuda.cu "Batch-1 decode knobs", and session 10's STRATA_GPU_ATT_V2); runs 51-52
# also had MV_STAGE, MV_LB, EXPERT_PF and MV_ROWS_SW (tests/engine/gpu/b1_candidates.patch), run 56 (b1)
# MV_ROWS_DENSE, MV_LB_SW / _DENSE and ROPE_PRE (tests/engine/gpu/b1_candidates10.patch)
SW="${SWITCHES:-STRATA_GPU_Q6_WIDE STRATA_GPU_ATT_PRE STRATA_GPU_ROUTER_PRE STRATA_GPU_MV_ROWS STRATA_GPU_ATT_V2}"
OFFS=""; for s in $SW; do OFFS="$OFFS $s=0"; done
KNOBS=""; for s in $SW; do KNOBS="$KNOBS --knob 1:$s=0"; done
DEFAULT_STEPS="
(python3 -m bench.engine_gpu --build-only > /tmp/model-build.log 2>&1) &
STRATA_CUDA_LIB=\$L/\$CAND.so python3 -m pytest -q -p no:cacheprovider -o addopts='' tests/engine/gpu/test_gpu_b1_knobs.py \
  tests/engine/gpu/test_gpu_kernels.py tests/engine/gpu/test_gpu_models.py > \$OUT/tests.log 2>&1
echo \"tests exit \$?: \$(tail -1 \$OUT/tests.log)\"; grep -E '^(FAILED|ERROR)' \$OUT/tests.log | head -20
wait
STRATA_CUDA_LIB=\$L/\$CAND.so python3 tests/engine/gpu/knob_bitwise.py $(echo $SW | tr ' ' ,) --values 0,1,2,8 \
  --seqs 1,2,8 --steps 3 2>&1 | tail -9
env $OFFS STRATA_CUDA_LIB=\$L/\$CAND.so python3 -m bench.engine_gpu --decode-only --lean --knob 1:STRATA_GPU_NONE=1 \
  2>&1 | grep '^decode (' | sed 's/^/all off: /'
STRATA_CUDA_LIB=\$L/\$CAND.so python3 -m bench.engine_gpu --decode-only --lean --json \$OUT/cand.json $KNOBS \
  --knob 1:STRATA_GPU_NONE=1 \${EXTRA_KNOBS:-} 2>&1 | grep '^decode ('
"
exec bash tests/engine/gpu/device_run.sh sh "${STEPS:-$DEFAULT_STEPS}"
