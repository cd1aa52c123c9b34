#!/usr/bin/env bash
# The prefill engineer's call (docs/gpu-runs.md, runs 41-42). Carry .whl, the libraries (or .pf/, an
# ignored folder of gzipped sm_90 builds NAME.so.gz, unpacked into engine/ here: they fit 64 MiB with
# .llama/bin-pack) and, for LLAMA=1, .llama/bin-pack. Without a carried engine/_strata_cuda.so the first
# library stands in for it (device_run.sh then has nothing to rebuild).
#   prefill_call.sh FIRST.so [OTHER.so...]
# FIRST: the prefill-form tests, the bitwise GEMM tests, then prefill_ab (pp512 / pp4096, median of 3)
# of its default, STRATA_GPU_GEMM_FAST_MIN=0 (the bitwise kernels) and SETS (extra "--set NAME ENV=V"
# arguments), with the kernel profile of its default; each OTHER: its default only. LLAMA=1: then
# llama.cpp's llama-bench pp512 / pp4096 on the same file (flash attention on, as bench.engine_gpu).
# AB=0: the tests only (no bench model, no timing). EXTRA_TESTS: more test files for the first pytest run
# (e.g. an untracked candidate's checks); PROFILE=NAME[,NAME]: the settings to profile (default: base).
set -u
OUT=${OUT:-/tmp/out}
cd "$(dirname "$0")/../../.." || exit 1
for z in .pf/*.so.gz; do [ -e "$z" ] && gunzip -c "$z" > "engine/$(basename "$z" .gz)"; done
[ -e engine/_strata_cuda.so ] || cp "$1" engine/_strata_cuda.so
touch engine/_strata_cuda.so
F=$(realpath "$1"); shift; others=""
for l in "$@"; do others="$others $(realpath "$l")"; done
exec bash tests/engine/gpu/device_run.sh sh "
[ \"${AB:-1}\" = 0 ] || (python3 -m bench.engine_gpu --build-only > /tmp/mb.log 2>&1) &
[ \"${LLAMA:-0}\" = 1 ] && bash tests/engine/gpu/build_llama_cuda.sh .llama/bin-pack /tmp/llama-build
P='python3 -m pytest -q -p no:cacheprovider -o addopts='
STRATA_CUDA_LIB=$F \$P -s tests/engine/gpu/test_gpu_gemm_prefill.py ${EXTRA_TESTS:-} > $OUT/t_fast.log 2>&1
echo prefill-form tests \$?: \$(tail -1 $OUT/t_fast.log); grep -E '^FAILED|^E  |vs matvec|vs k_linear|logits vs|fast qkv' $OUT/t_fast.log | head -30
STRATA_CUDA_LIB=$F \$P tests/engine/gpu/test_gpu_kernels.py -k 'gemm_bitwise or routed or qkv' > $OUT/t_k.log 2>&1
echo bitwise GEMM tests \$?: \$(tail -1 $OUT/t_k.log)
[ \"${AB:-1}\" = 0 ] && exit 0
wait; tail -1 /tmp/mb.log
ABR='python3 -m tests.engine.gpu.prefill_ab'
STRATA_CUDA_LIB=$F \$ABR --set off STRATA_GPU_GEMM_FAST_MIN=0 ${SETS:-} --profile ${PROFILE:-base} > $OUT/ab.log 2>&1
echo prefill_ab exit \$?  # run 51's process aborted at exit after printing everything: say so
grep -E 'median|==|^  [A-Za-z0-9]' $OUT/ab.log | grep -v '  other: Mem'
for l in $others; do STRATA_CUDA_LIB=\$l \$ABR 2>&1 | grep median; echo \$l exit \${PIPESTATUS[0]}; done
if [ \"${LLAMA:-0}\" = 1 ]; then
  LD_LIBRARY_PATH=/tmp/llama-build/bin:\${LD_LIBRARY_PATH:-} /tmp/llama-build/bin/llama-bench \
    -m /tmp/strata-bench/qwen3moe-synth-48L-skew1.gguf -ngl 99 -fa 1 -p 512,4096 -n 0 -r 3 -o md 2>&1 | tail -5
fi
"
