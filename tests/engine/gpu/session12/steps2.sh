set -u
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
(nice -n 19 bash tests/engine/gpu/build_llama_cuda.sh $(ls .llama/llama.cpp-*.tar.gz | head -1) /tmp/llama-build /tmp/lpack > /tmp/llama-build.log 2>&1; echo "llama build exit $?" >> /tmp/llama-build.log) &
LB=$!
(python3 -m bench.engine_gpu --build-only > /tmp/model-build.log 2>&1) &
G=tests/engine/gpu
timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" $G/test_gpu_b1_knobs.py $G/test_gpu_att_b1.py \
  $G/test_gpu_norm_fast.py $G/test_gpu_kernels.py > $OUT/cand_tests.log 2>&1
el "candidate tests exit $?: $(tail -1 $OUT/cand_tests.log)"; grep -E '^(FAILED|ERROR)' $OUT/cand_tests.log | head
STRATA_GPU_GU_CHUNK=1 STRATA_GPU_NORM_FAST=1 STRATA_GPU_ATT_B1=2 timeout 60 python3 -m pytest -q -p no:cacheprovider \
  -o addopts="" $G/test_gpu_models.py >> $OUT/cand_tests.log 2>&1
el "models with GU 1 / NF 1 / AB 2 exit $?: $(tail -1 $OUT/cand_tests.log)"; grep -E '^(FAILED|ERROR)' $OUT/cand_tests.log | head
for i in $(seq 60); do [ -s /tmp/strata-bench/qwen3moe-synth-48L-skew1.gguf ] && ! pgrep -f "engine_gpu --build-only" > /dev/null && break; sleep 2; done
el "model: $(tail -1 /tmp/model-build.log)"
for k in GU_CHUNK NORM_FAST ATT_B1; do
  timeout 60 python3 $G/knob_bitwise.py STRATA_GPU_$k --values 0,1,2,3 --seqs 1,2 --steps 3 2>&1 | grep -E "sequences|rror|differ" | grep -vE "bitwise equal" ; el "kb $k"
done
R=""; for v in 1 2 3; do for k in GU_CHUNK NORM_FAST ATT_B1; do R="$R --knob 1:STRATA_GPU_$k=$v"; done; done
R2=""; for v in 01 02 03; do for k in GU_CHUNK NORM_FAST ATT_B1; do R2="$R2 --knob 1:STRATA_GPU_$k=$v"; done; done
timeout 170 python3 -m bench.engine_gpu --decode-only --lean --json /tmp/rows1.json --knob 1:STRATA_GPU_NONE=1 $R \
  --knob 1:STRATA_GPU_NONE=2 $R2 --knob 1:STRATA_GPU_NONE=3 > $OUT/rows.log 2>&1
el "rows exit $?"
python3 .val/pick.py /tmp/rows1.json > /tmp/pick.env; cat /tmp/pick.env
set -a; . /tmp/pick.env; set +a
timeout 120 python3 -m bench.engine_gpu --decode-only --lean --json /tmp/rows2.json --knob 1:STRATA_GPU_NONE=1 \
  --knob 1:STRATA_GPU_GU_CHUNK=0 --knob 1:STRATA_GPU_NORM_FAST=0 --knob 1:STRATA_GPU_ATT_B1=0 --knob 1:STRATA_GPU_NONE=2 \
  --knob 8:STRATA_GPU_NONE=1 --knob 4:STRATA_GPU_NONE=1 >> $OUT/rows.log 2>&1
el "combo rows exit $?"; grep -E '^decode \(|^scheduler' $OUT/rows.log | tail -2 | cut -c1-1500
STRATA_GPU_GU_CHUNK=0 STRATA_GPU_NORM_FAST=0 STRATA_GPU_ATT_B1=0 timeout 90 python3 -m bench.engine_gpu --decode-only --lean \
  --knob 1:STRATA_GPU_NONE=1 --knob 4:STRATA_GPU_NONE=1 >> $OUT/rows.log 2>&1
el "all-off process exit $?"; grep -E '^decode \(' $OUT/rows.log | tail -1 | cut -c1-900
wait $LB; el "$(tail -1 /tmp/llama-build.log)"; ls -la /tmp/lpack 2>/dev/null | tail -3
