#!/usr/bin/env bash
# Session 12, call 3 (docs/gpu-runs.md run 73): carry .whl .val .llama (the llama.cpp binaries packed by run 72 in
# .llama/bin-pack). HEAD's library with GU_CHUNK / ATT_B1 on by default: the whole GPU suite, the landed knobs'
# same-bits check, then the full bench with llama.cpp on the same file (the same-run table).
set -u
REAL=${OUT:-/tmp/out}; mkdir -p "$REAL" /tmp/o3
cd "$(dirname "$0")/.." || exit 1
gunzip -c .val/land3.so.gz > engine/_strata_cuda.so && touch engine/_strata_cuda.so || exit 1
export OUT=/tmp/o3 REAL
bash tests/engine/gpu/device_run.sh sh "bash .val/steps3.sh"
cp /tmp/o3/pytest.log /tmp/o3/bench.log /tmp/bench.json "$REAL"/ 2>/dev/null; ls "$REAL"
