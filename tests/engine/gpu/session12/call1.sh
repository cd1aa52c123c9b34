#!/usr/bin/env bash
# Session 12, call 1 (docs/gpu-runs.md run 71): carry .whl .val .llama. HEAD's whole GPU suite (overlap on by default),
# nb1's Q6_HEAD candidate + the deletion profile (STRATA_GPU_DIAG_SKIP, timing only) in cand12, llama.cpp built beside
# (nice 19) and packed back through $OUT/lpack.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/l
cd "$(dirname "$0")/.." || exit 1
gunzip -c .val/head12.so.gz > engine/_strata_cuda.so && touch engine/_strata_cuda.so || exit 1
gunzip -c .val/cand12.so.gz > /tmp/l/nb1q6h.so || exit 1
export OUT
exec bash tests/engine/gpu/device_run.sh sh "bash .val/steps1.sh"
