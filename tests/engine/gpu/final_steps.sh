# The steps of final_call.sh (session 11, run 70), run after device_run.sh's setup with OUT set.
set -u
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
(nice -n 19 bash tests/engine/gpu/build_llama_cuda.sh $(ls .llama/llama.cpp-*.tar.gz | head -1) /tmp/llama-build > /tmp/llama-build.log 2>&1; echo "llama build exit $?" >> /tmp/llama-build.log) &
LB=$!
(python3 -m bench.engine_gpu --build-only > /tmp/model-build.log 2>&1) &
STRATA_STACK_REPORT=/tmp/stack.json timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs --durations=5 \
  tests/engine/gpu tests/engine/test_gpu_cpu_side.py -k "not compile" > $OUT/pytest.log 2>&1
el "HEAD suite exit $?"; tail -9 $OUT/pytest.log | grep -v "^$"
STRATA_OVERLAP=1 timeout 40 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/engine/gpu/test_gpu_scheduler.py \
  tests/engine/gpu/test_gpu_models.py > /tmp/overlap_forced.log 2>&1
el "scheduler + models with STRATA_OVERLAP=1 exit $?: $(tail -1 /tmp/overlap_forced.log)"; grep -E "^(FAILED|ERROR)" /tmp/overlap_forced.log | head
for i in $(seq 60); do [ -s /tmp/strata-bench/qwen3moe-synth-48L-skew1.gguf ] && ! pgrep -f "engine_gpu --build-only" > /dev/null && break; sleep 2; done
el "model: $(tail -1 /tmp/model-build.log)"
timeout 40 python3 tests/engine/gpu/knob_bitwise.py STRATA_GPU_ROUTER_MLP --seqs 16,24,32 2>&1 | grep -E "sequences|rror|differ"; el kb
timeout 150 python3 -m bench.engine_gpu --decode-only --lean --knob 1:STRATA_GPU_NONE=1 --knob 32:STRATA_GPU_ROUTER_MLP=0 \
  --knob 32:STRATA_GPU_NONE=2 > $OUT/decode_head.log 2>&1
el "decode-only HEAD exit $?"; grep -E '^decode \(|^scheduler decode|rror' $OUT/decode_head.log
wait $LB; el "$(tail -2 /tmp/llama-build.log | tr '\n' ' ')"
timeout 200 python3 -m bench.engine_gpu --llama-bin /tmp/llama-build/bin --json /tmp/bench.json > $OUT/bench.log 2>&1
el "bench exit $?"; tail -32 $OUT/bench.log
cp /tmp/l/test_gpu_b1_knobs_qin.py tests/engine/gpu/test_gpu_b1_knobs.py
C=/tmp/l/qin11.so
STRATA_CUDA_LIB=$C timeout 60 python3 -m pytest -q -p no:cacheprovider -o addopts='' tests/engine/gpu/test_gpu_b1_knobs.py \
  tests/engine/gpu/test_gpu_kernels.py -k "routed or rows or unroll or quantisation or decode_steps" > /tmp/qin_tests.log 2>&1
el "qin tests exit $?: $(tail -1 /tmp/qin_tests.log)"; grep -E "^(FAILED|ERROR)" /tmp/qin_tests.log | head
STRATA_CUDA_LIB=$C timeout 40 python3 tests/engine/gpu/knob_bitwise.py STRATA_GPU_DOWN_QIN --values 0,1 --seqs 1,2,4 --steps 3 2>&1 \
  | grep -E "sequences|rror|differ"; el "qin kb"
K=STRATA_GPU
STRATA_CUDA_LIB=$C timeout 80 python3 -m bench.engine_gpu --decode-only --lean --knob 1:${K}_DOWN_QIN=1 \
  --knob 1:${K}_NONE=1 --knob 1:${K}_DOWN_QIN=01 --knob 4:${K}_DOWN_QIN=1 --knob 4:${K}_NONE=1 --knob 1:${K}_NONE=2 \
  --knob 1:${K}_DOWN_QIN=001 2>&1 | grep -E '^decode \(|rror' ; el "qin bench"
