set -u
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
bash tests/engine/gpu/build_llama_cuda.sh .llama/bin-pack /tmp/llama-build
(python3 -m bench.engine_gpu --build-only > /tmp/model-build.log 2>&1) &
STRATA_STACK_REPORT=/tmp/stack.json timeout 170 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs --durations=3 \
  tests/engine/gpu tests/engine/test_gpu_cpu_side.py -k "not compile" > $OUT/pytest.log 2>&1
el "HEAD suite exit $?"; tail -9 $OUT/pytest.log | grep -v "^$"; grep -E '^(FAILED|ERROR)' $OUT/pytest.log | head
for i in $(seq 60); do [ -s /tmp/strata-bench/qwen3moe-synth-48L-skew1.gguf ] && ! pgrep -f "engine_gpu --build-only" > /dev/null && break; sleep 2; done
el "model: $(tail -1 /tmp/model-build.log)"
timeout 50 python3 tests/engine/gpu/knob_bitwise.py STRATA_GPU_GU_CHUNK --values 2,0,1 --seqs 1,2,4 --steps 3 2>&1 | tail -6
timeout 50 python3 tests/engine/gpu/knob_bitwise.py STRATA_GPU_ATT_B1 --values 3,0,1,2 --seqs 1,2,8 --steps 3 2>&1 | tail -9
el kb
timeout 260 python3 -m bench.engine_gpu --llama-bin /tmp/llama-build/bin --json /tmp/bench.json > $OUT/bench.log 2>&1
el "bench exit $?"; tail -34 $OUT/bench.log
