#!/usr/bin/env bash
# One call on the GPU machine (see docs/gpu-runs.md): install the carried wheels, build the C
# engine there (its python is 3.12), use the carried CUDA library or build it, probe the
# machine, then run what is asked: `device_run.sh tests [pytest args]`, `device_run.sh bench [args]`.
# Logs go to $OUT; a short table is printed last.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
cd "$(dirname "$0")/../../.." || exit 1
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$OUT/pip.log" 2>&1 || { tail -5 "$OUT/pip.log"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD
{
  echo "== probe"; date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  nvcc --version | tail -2; python3 --version; gcc --version | head -1
  python3 -c "import sysconfig, os; p = sysconfig.get_paths()['include']; print('Python.h', os.path.exists(p + '/Python.h'))"
  python3 -c "import torch, transformers, cffi, gguf, pydantic; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cffi', cffi.__version__, 'gguf ok')"
} > "$OUT/probe.log" 2>&1
cat "$OUT/probe.log"
t0=$(date +%s)
python3 -m engine._build > "$OUT/build.log" 2>&1 || { echo "C engine build failed"; tail -20 "$OUT/build.log"; exit 1; }
python3 -m engine._build_cuda >> "$OUT/build.log" 2>&1 || { echo "CUDA build failed"; tail -20 "$OUT/build.log"; exit 1; }
echo "builds: $(( $(date +%s) - t0 )) s"; tail -2 "$OUT/build.log"
what=${1:-tests}; shift || true
case "$what" in
  tests)
    set -o pipefail
    python3 -m pytest -q -p no:cacheprovider -o addopts="" "${@:-tests/engine/gpu}" 2>&1 | tee "$OUT/pytest.log" | tail -40
    ;;
  bench)
    python3 -m bench.engine_gpu "$@" 2>&1 | tee "$OUT/bench.log" | tail -40
    ;;
  sh)  # any commands after the setup, e.g. several steps in one call
    bash -c "$*"
    ;;
  *) echo "unknown: $what"; exit 2 ;;
esac
