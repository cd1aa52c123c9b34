set -u
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
(nice -n 19 bash tests/engine/gpu/build_llama_cuda.sh $(ls .llama/llama.cpp-*.tar.gz | head -1) /tmp/llama-build $OUT/lpack > /tmp/llama-build.log 2>&1; echo "llama build exit $?" >> /tmp/llama-build.log) &
LB=$!
(python3 -m bench.engine_gpu --build-only > /tmp/model-build.log 2>&1) &
STRATA_STACK_REPORT=/tmp/stack.json timeout 170 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs --durations=5 \
  tests/engine/gpu tests/engine/test_gpu_cpu_side.py -k "not compile" > $OUT/pytest.log 2>&1
el "HEAD suite exit $?"; tail -12 $OUT/pytest.log | grep -v "^$"
for i in $(seq 60); do [ -s /tmp/strata-bench/qwen3moe-synth-48L-skew1.gguf ] && ! pgrep -f "engine_gpu --build-only" > /dev/null && break; sleep 2; done
el "model: $(tail -1 /tmp/model-build.log)"
# deletion profile (cand12 = HEAD + nb1's Q6_HEAD + STRATA_GPU_DIAG_SKIP; timing only, wrong logits)
C=/tmp/l/nb1q6h.so; D=STRATA_GPU_DIAG_SKIP
STRATA_CUDA_LIB=$C timeout 150 python3 -m bench.engine_gpu --decode-only --lean --knob 1:STRATA_GPU_NONE=1 \
  --knob 1:$D=1 --knob 1:$D=2 --knob 1:$D=4 --knob 1:$D=16 --knob 1:$D=32 --knob 1:$D=64 --knob 1:$D=128 \
  --knob 1:$D=256 --knob 1:STRATA_GPU_NONE=2 --knob 1:$D=01 --knob 1:$D=02 --knob 1:$D=0256 --knob 1:$D=8 \
  --knob 1:STRATA_GPU_NONE=3 > /tmp/diag.log 2>&1
el "diag exit $?"; grep -E '^decode \(|^scheduler decode|rror' /tmp/diag.log
# nb1's candidate (its script: tests, knob_bitwise, rows, ncu)
L=/tmp/l bash tests/engine/gpu/b1_next_steps.sh 2>&1 | grep -v "^$"
el "nb1 done"
# torch-profiler kernel times at batch 1 (HEAD library)
timeout 90 python3 -m bench.engine_gpu --profile-decode > /tmp/prof.log 2>&1
el "profile exit $?"; grep -E "^==|k_|Self CUDA time total" /tmp/prof.log | cut -c1-175 | head -32
wait $LB; el "$(tail -2 /tmp/llama-build.log | tr '\n' ' ')"; ls -la $OUT/lpack 2>/dev/null
