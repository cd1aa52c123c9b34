#!/usr/bin/env bash
# One whole call on the GPU machine (docs/gpu-runs.md), carrying .whl, .llama and
# engine/_strata_cuda.so: the wheels also into the image's own Python (the stack test's
# `make switch` and the lanes' --check-config reset PYTHONPATH to the repository), llama.cpp's
# binaries from the carried pack, then device_run.sh: every GPU test (the whole stack of
# tests/engine/gpu/test_gpu_stack.py included, its report in $OUT/stack.json) and the benchmark
# with llama.cpp in the same run. At most 8 files come back: pip/probe/build logs, pytest.log,
# stack.json, bench.log, bench.json, bench.profile.txt (with --profile).
#
#   session_call.sh [tests|bench|all|ncu] [bench.engine_gpu args...]
#   session_call.sh ab OTHER.so [MORE.so...]   (after another mode in the same call, or alone)
#   session_call.sh try OTHER.so [MORE.so...]  (each one's bitwise tests, ab, ncu of the first)
#
# ncu: Nsight Compute (--clock-control none, as the device notes ask) on one 512-token prefill
# step (the GEMM launches and the grouping of layer 0: occupancy, stall reasons, memory
# throughput) and on the last 512-token chunk of a 4,096-token prompt with the query-tile
# attention; text reports in $OUT/ncu.txt (builds the bench model if it is missing).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
cd "$(dirname "$0")/../../.." || exit 1
what=${1:-all}; shift || true
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl > /tmp/site-pip.log 2>&1 \
    || echo "wheels into the image's Python failed: $(tail -2 /tmp/site-pip.log)"
# ab: one 512- and one 4,096-token prefill, 3 times each, with the carried library and with
# each OTHER.so (another version of the CUDA sources, built for sm_90 only by `python -m
# engine._build_cuda --sm90-out OTHER.so` and carried too): a before/after in the same call.
if [ "$what" = ab ]; then
  [ $# -ge 1 ] || { echo "ab needs at least one other library"; exit 2; }
  libs="$PWD/engine/_strata_cuda.so"
  for l in "$@"; do libs="$libs $(realpath "$l")"; done
  exec bash tests/engine/gpu/device_run.sh sh "python3 -m bench.engine_gpu --build-only > /tmp/model-build.log 2>&1 &&
    for n in 512 4096; do for l in $libs; do
      STRATA_CUDA_LIB=\$l python3 -m bench.engine_gpu --prefill-only \$n --repeat 3 2>&1 | tail -1; done; done"
fi
if [ "$what" = ncu ]; then
  exec bash tests/engine/gpu/device_run.sh sh "bash tests/engine/gpu/ncu_prefill.sh"
fi
# try: for each OTHER.so the bitwise kernel and model tests ($OUT/try-NAME.log), then ab against the
# carried library (PREFILL=0 skips it), the decode rates of each (bench --decode-only; DECODE_ARGS=--lean: its short form), the first
# OTHER.so's decode profile ($OUT/prof.profile.txt, prof.json; PROFILE=0 skips it), its SASS with SASS=1
# ($OUT/sass.txt.gz) and Nsight Compute with it (NCU=0 skips that): a candidate's whole check in one setup.
if [ "$what" = try ]; then
  [ $# -ge 1 ] || { echo "try needs at least one other library"; exit 2; }
  libs="$PWD/engine/_strata_cuda.so"; first=$(realpath "$1")
  for l in "$@"; do libs="$libs $(realpath "$l")"; done
  exec bash tests/engine/gpu/device_run.sh sh "(python3 -m bench.engine_gpu --build-only > /tmp/model-build.log 2>&1) &
    for l in $libs; do [ \$l = $PWD/engine/_strata_cuda.so ] && continue; n=\$(basename \$l .so)
      STRATA_CUDA_LIB=\$l python3 -m pytest -q -p no:cacheprovider -o addopts='' tests/engine/gpu/test_gpu_kernels.py \
        tests/engine/gpu/test_gpu_models.py > $OUT/try-\$n.log 2>&1; echo \"\$n: pytest exit \$?: \$(tail -1 $OUT/try-\$n.log)\"; done
    wait
    [ \"\${PREFILL:-1}\" = 0 ] || for n in 512 4096; do for l in $libs; do
      STRATA_CUDA_LIB=\$l python3 -m bench.engine_gpu --prefill-only \$n --repeat 3 2>&1 | tail -1; done; done
    for l in $libs; do STRATA_CUDA_LIB=\$l python3 -m bench.engine_gpu --decode-only ${DECODE_ARGS:-} 2>&1 | grep '^decode ('; done
    [ \"\${PROFILE:-1}\" = 0 ] || STRATA_CUDA_LIB=$first python3 -m bench.engine_gpu --profile-decode \
      --json $OUT/prof.json > /tmp/prof.log 2>&1 || tail -5 /tmp/prof.log
    [ \"\${SASS:-0}\" = 0 ] || cuobjdump --dump-sass $first 2>&1 | gzip > $OUT/sass.txt.gz
    [ \"\${NCU:-1}\" = 0 ] || STRATA_CUDA_LIB=$first bash tests/engine/gpu/ncu_prefill.sh"
fi
# llama.cpp: the carried binaries (.llama/bin-pack); without them, built here from the carried source
# tarball (.llama/llama.cpp-*.tar.gz, ~240 s on 16 cores) at nice 19 beside the tests, the bench waiting
# for it; its pack comes back in $OUT (llama-bin.tar.xz.part-aa) only if it is one part (8 files at most)
llama_bg=0
if [ "$what" != tests ]; then
  # carried binaries (possibly built on a machine without a GPU: build_llama_cuda.sh's driver stub) must
  # load here: `llama-bench --help` resolves every shared library; if not, build from the tarball instead
  if [ -d .llama/bin-pack ]; then bash tests/engine/gpu/build_llama_cuda.sh .llama/bin-pack /tmp/llama-build
    /tmp/llama-build/bin/llama-bench --help > /tmp/llama-help.log 2>&1 \
      || { echo "llama.cpp: carried binaries do not load: $(head -c 300 /tmp/llama-help.log)"; rm -rf /tmp/llama-build; }
  fi
  # LLAMA_BUILD=0: no build here (a call short of device time): then the bench runs without llama.cpp
  if [ ! -x /tmp/llama-build/bin/llama-bench ] && [ "${LLAMA_BUILD:-1}" = 0 ]; then
    echo "llama.cpp: no binaries and LLAMA_BUILD=0: the bench runs without it"
  elif [ ! -x /tmp/llama-build/bin/llama-bench ]; then
    llama_bg=1; echo "llama.cpp: building from $(ls .llama/llama.cpp-*.tar.gz | head -1)"; fi
fi
cat > /tmp/session_steps.sh <<EOF
set -u
if [ "$what" != tests ]; then (python3 -m bench.engine_gpu --build-only > /tmp/model-build.log 2>&1) & fi
if [ $llama_bg = 1 ]; then (nice -n 19 bash tests/engine/gpu/build_llama_cuda.sh \$(ls .llama/llama.cpp-*.tar.gz | head -1) \
    /tmp/llama-build /tmp/llama-pack > /tmp/llama-build.log 2>&1
  n=\$(ls /tmp/llama-pack/llama-bin.tar.xz.part-* 2>/dev/null | wc -l)
  [ "\$n" = 1 ] && cp /tmp/llama-pack/llama-bin.tar.xz.part-aa $OUT/) & fi
if [ "$what" != bench ]; then
  t0=\$(date +%s)
  STRATA_STACK_REPORT=$OUT/stack.json python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs --durations=6 \
      tests/engine/gpu tests/engine/test_gpu_cpu_side.py -k "not compile" > $OUT/pytest.log 2>&1
  echo "pytest exit \$? in \$(( \$(date +%s) - t0 )) s"; tail -22 $OUT/pytest.log
fi
wait
if [ $llama_bg = 1 ]; then grep '^llama.cpp' /tmp/llama-build.log || tail -5 /tmp/llama-build.log; ls -la /tmp/llama-pack; fi
if [ "$what" != tests ]; then
  t0=\$(date +%s)
  python3 -m bench.engine_gpu --llama-bin /tmp/llama-build/bin --json $OUT/bench.json $* > $OUT/bench.log 2>&1
  echo "bench exit \$? in \$(( \$(date +%s) - t0 )) s"; tail -45 $OUT/bench.log
fi
EOF
bash tests/engine/gpu/device_run.sh sh "bash /tmp/session_steps.sh"
