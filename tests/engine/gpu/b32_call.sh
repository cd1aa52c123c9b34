#!/usr/bin/env bash
# One decode call on the GPU machine (session 9, 32-sequence decode; docs/gpu-runs.md runs 47+).
# Carry `.whl` and `.b32` (gzipped sm_90 libraries, `.b32/NAME.so.gz`; the ignored folder keeps the
# working tree under 64 MiB). HEAD's library (HEAD=NAME, default _strata_cuda_head9) becomes
# engine/_strata_cuda.so there (touched, so device_run.sh does not rebuild it); every library lands
# in /tmp/l/NAME.so. Then `bash -c "$STEPS"` after device_run.sh's setup, with L=/tmp/l and
# OUT set, e.g.
#   STEPS='STRATA_CUDA_LIB=$L/x.so python3 -m bench.engine_gpu --decode-only --lean' bash tests/engine/gpu/b32_call.sh
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/l
cd "$(dirname "$0")/../../.." || exit 1
for f in .b32/*.so.gz; do gunzip -c "$f" > "/tmp/l/$(basename "$f" .gz)" || exit 1; done
cp "/tmp/l/${HEAD:-_strata_cuda_head9}.so" engine/_strata_cuda.so && touch engine/_strata_cuda.so || exit 1
export L=/tmp/l OUT
exec bash tests/engine/gpu/device_run.sh sh "$STEPS"
