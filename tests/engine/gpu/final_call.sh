# Recorded as run (session 11's final call, docs/gpu-runs.md run 70): prepare .val/ as that entry says (headF.tgz =
# git archive HEAD engine tests bench, headF.so.gz = an sm_90 build of HEAD, untracked.txt), then carry .whl .val .llama .b1.
#!/usr/bin/env bash
# Session 11's final call (docs/gpu-runs.md run 70): HEAD's whole GPU suite, the overlap forced on, ROUTER_MLP's
# same bits, HEAD's decode-only rows (device pick / host argmax / overlap / scheduler), b1's DOWN_QIN candidate, and
# the full bench with llama.cpp built here from the carried tarball (at nice 19 beside the steps). Carry .whl, .val,
# .llama, .b1.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/l
cd "$(dirname "$0")/../../.." || exit 1
cp .b1/test_gpu_b1_knobs_qin.py /tmp/l/ && tar xzf .val/headF.tgz && xargs -r rm -f < .val/untracked.txt
gunzip -c .val/headF.so.gz > engine/_strata_cuda.so && touch engine/_strata_cuda.so || exit 1
gunzip -c .b1/qin11.so.gz > /tmp/l/qin11.so || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl > /tmp/site-pip.log 2>&1 \
    || echo "wheels into the image's Python failed: $(tail -2 /tmp/site-pip.log)"
export OUT
exec bash tests/engine/gpu/device_run.sh sh "bash tests/engine/gpu/final_steps.sh"
