#!/usr/bin/env bash
# Session 12, call 2 (docs/gpu-runs.md run 72): carry .whl .val .llama. The merged batch-1 candidates (cand2.so) against
# HEAD's library (head2.so), llama.cpp built beside and packed back (parts only into the returned $OUT).
set -u
REAL=${OUT:-/tmp/out}; mkdir -p "$REAL" /tmp/l /tmp/o2
cd "$(dirname "$0")/.." || exit 1
tar xzf .val/m2.tgz || exit 1  # the merged candidates' CUDA sources, header and tests over the device tree
gunzip -c .val/head2.so.gz > /tmp/l/head2.so || exit 1
gunzip -c .val/cand2.so.gz > engine/_strata_cuda.so && touch engine/_strata_cuda.so || exit 1
export OUT=/tmp/o2 REAL
bash tests/engine/gpu/device_run.sh sh "bash .val/steps2.sh"
cp /tmp/lpack/llama-bin.tar.xz.part-* "$REAL"/ 2>/dev/null; cp /tmp/o2/cand_tests.log /tmp/o2/rows.log "$REAL"/ 2>/dev/null
ls "$REAL"
