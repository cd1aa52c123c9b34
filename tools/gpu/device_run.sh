#!/usr/bin/env bash
# One call on the lent GPU machine (tools/gpu/README.md): install the carried wheels (.whl/), build
# the C engine there (its Python is 3.12) and the CUDA engine (kept when a carried
# engine/_strata_cuda.so is up to date), probe the machine, then run what is asked:
#
#   device_run.sh verify [bench args]   every GPU test, then bench.engine_gpu with llama.cpp (.llama/) in the same run
#   device_run.sh tests [pytest args]   the GPU tests (default: tests/engine/gpu)
#   device_run.sh bench [bench args]    python -m bench.engine_gpu
#   device_run.sh depth [D1,D2,...] [bench args]   batch-1 decode at depth (bench/engine_gpu_depth.py) beside
#                                       llama-bench -d, llama.cpp from .llama/bin-pack (default depths 0,8192,32768)
#   device_run.sh hybrid [bench args]   python -m bench.engine_hybrid beside llama.cpp from .llama/bin-pack
#   device_run.sh sh "COMMANDS"         any commands after the setup (e.g. bash tools/gpu/ncu_decode.sh)
#
# Logs go to $OUT (at most 8 files come back): pip, probe and build logs, pytest.log, stack.json,
# bench.log, bench.json.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
cd "$(dirname "$0")/../.." || exit 1
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
# every GPU test: the GPU folder and the CPU-side checks of the GPU engine (their nvcc compile check
# is CI's; the build above already compiled the same sources)
gpu_tests=(tests/engine/gpu tests/engine/test_gpu_cpu_side.py -k "not compile")
# lb: the benchmark's --llama-bin argument when .llama/bin-pack unpacks into /tmp/llama-build and loads here
llama_from_pack() {
  llama=/tmp/llama-build
  lb=()
  if [ -d .llama/bin-pack ] && bash tools/gpu/build_llama_cuda.sh .llama/bin-pack "$llama" > /tmp/llama-unpack.log 2>&1 \
      && "$llama/bin/llama-bench" --help > /dev/null 2>&1; then
    lb=(--llama-bin "$llama/bin")
  else
    echo "llama.cpp: no loadable .llama/bin-pack (tools/gpu/build_llama_cuda.sh): Strata only"
  fi
}
what=${1:-tests}; shift || true
case "$what" in
  verify)
    el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
    t0=$(date +%s)
    # llama.cpp: binaries packed earlier (.llama/bin-pack, build_llama_cuda.sh's PACK_DIR) if they load
    # here, else built from the source tarball (.llama/llama.cpp-*.tar.gz, ~240-280 s on 16 cores) at
    # nice 19 beside the tests
    llama=/tmp/llama-build
    if [ -d .llama/bin-pack ]; then
      bash tools/gpu/build_llama_cuda.sh .llama/bin-pack "$llama"
      "$llama/bin/llama-bench" --help > /tmp/llama-help.log 2>&1 \
        || { echo "llama.cpp: packed binaries do not load: $(head -c 300 /tmp/llama-help.log)"; rm -rf "$llama"; }
    fi
    lpid=
    if [ ! -x "$llama/bin/llama-bench" ]; then
      src=$(ls .llama/llama.cpp-*.tar.gz 2>/dev/null | head -1)
      [ -n "$src" ] || { echo "llama.cpp: no .llama/bin-pack and no .llama/llama.cpp-*.tar.gz (tools/gpu/pack_llama_src.sh)"; exit 1; }
      (nice -n 19 bash tools/gpu/build_llama_cuda.sh "$src" "$llama" > /tmp/llama-build.log 2>&1) &
      lpid=$!
    fi
    (python3 -m bench.engine_gpu --build-only "$@" > /tmp/model-build.log 2>&1) &
    mpid=$!
    STRATA_STACK_REPORT=$OUT/stack.json python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs --durations=5 \
        "${gpu_tests[@]}" > "$OUT/pytest.log" 2>&1
    rc=$?
    el "GPU tests exit $rc"; tail -12 "$OUT/pytest.log"; grep -E '^(FAILED|ERROR)' "$OUT/pytest.log" | head -20
    wait $mpid || { el "bench model build failed"; tail -5 /tmp/model-build.log; exit 1; }
    if [ -n "$lpid" ]; then wait $lpid; el "$(grep '^llama.cpp' /tmp/llama-build.log || tail -5 /tmp/llama-build.log)"; fi
    python3 -m bench.engine_gpu --llama-bin "$llama/bin" --json "$OUT/bench.json" "$@" > "$OUT/bench.log" 2>&1
    brc=$?
    el "bench exit $brc"; tail -40 "$OUT/bench.log"
    exit $(( rc | brc ))
    ;;
  tests)
    set -o pipefail
    if [ $# -eq 0 ]; then set -- "${gpu_tests[@]}"; fi
    python3 -m pytest -q -p no:cacheprovider -o addopts="" "$@" 2>&1 | tee "$OUT/pytest.log" | tail -40
    ;;
  bench)
    set -o pipefail
    python3 -m bench.engine_gpu "$@" 2>&1 | tee "$OUT/bench.log" | tail -40
    ;;
  depth)
    llama_from_pack
    depths=${1:-0,8192,32768}; shift || true
    set -o pipefail
    python3 -m bench.engine_gpu --depth "$depths" ${lb[@]+"${lb[@]}"} --json "$OUT/depth.json" "$@" 2>&1 \
        | tee "$OUT/depth.log" | tail -40
    ;;
  hybrid)
    # issue 29's benchmark (bench/engine_hybrid.py) beside llama.cpp from .llama/bin-pack; its log and JSON in $OUT
    llama_from_pack
    set -o pipefail
    python3 -m bench.engine_hybrid ${lb[@]+"${lb[@]}"} --json "$OUT/hybrid.json" "$@" 2>&1 | tee "$OUT/hybrid.log"
    ;;
  sh)
    bash -c "$*"
    ;;
  *) echo "unknown: $what (verify, tests, bench, depth, hybrid or sh)"; exit 2 ;;
esac
