#!/usr/bin/env bash
# Session 12, run 75: the review's host-side changes (launch_kx, the harness's fused-quant reset): every GPU test.
set -u
REAL=${OUT:-/tmp/out}; mkdir -p "$REAL" /tmp/o4
cd "$(dirname "$0")/.." || exit 1
gunzip -c .val/rev4.so.gz > engine/_strata_cuda.so && touch engine/_strata_cuda.so || exit 1
export OUT=/tmp/o4
bash tests/engine/gpu/device_run.sh sh 'timeout 170 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs tests/engine/gpu tests/engine/test_gpu_cpu_side.py -k "not compile" > $OUT/pytest.log 2>&1; echo "suite exit $?"; tail -6 $OUT/pytest.log; grep -E "^(FAILED|ERROR)" $OUT/pytest.log | head'
cp /tmp/o4/pytest.log "$REAL"/
