#!/usr/bin/env bash
# One device call for the tensor-core prefill attention (attention_mma.cuh; docs/gpu-runs.md,
# attention engineer). Every GPU use goes through LIB (STRATA_CUDA_LIB: HEAD + the hook, built
# for sm_90 with `python -m engine._build_cuda --sm90-out`), so the carried engine/_strata_cuda.so
# is neither needed nor rebuilt; the old kernel is the same library with STRATA_GPU_ATT_MMA=0.
#   [T3=0] [NCU=1] attn_mma_call.sh [LIB]   (carry .whl and LIB; logs in $OUT: t1 kernels, t2 models +
#       scheduler at the default, t3 the same with every eager prefill run on the mma kernel (T3=0
#       skips), ab.log the prefill A/B (fp32 tiles / mma, q one f16 / mma default), prof.txt kernel
#       times of a 4,096 prefill, ncu.txt Nsight Compute on 2 mma launches of its last chunk (NCU=1))
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
cd "$(dirname "$0")/../../.." || exit 1
LIB=$(realpath "${1:-engine/_strata_cuda_attn.so}")
export PYTHONUNBUFFERED=1 STRATA_CUDA_LIB=$LIB
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > /tmp/pip.log 2>&1 || { tail -5 /tmp/pip.log; exit 1; }
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
python3 -m engine._build > /tmp/build.log 2>&1 || { echo "C engine build failed"; tail -20 /tmp/build.log; exit 1; }
(python3 -m bench.engine_gpu --build-only > /tmp/model-build.log 2>&1) &
PT="python3 -m pytest -q -p no:cacheprovider -o addopts= -rs"
t0=$(date +%s)
$PT -s tests/engine/gpu/test_gpu_attention_mma.py tests/engine/gpu/test_gpu_kernels.py -k "attention or mma_row or long_prompt" > "$OUT/t1.log" 2>&1
echo "t1 kernels: exit $? in $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/t1.log")"; grep -E "err|sharp|logits vs" "$OUT/t1.log"
t0=$(date +%s)
$PT --durations=5 tests/engine/gpu/test_gpu_models.py tests/engine/gpu/test_gpu_scheduler.py > "$OUT/t2.log" 2>&1
echo "t2 models+scheduler (default): exit $? in $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/t2.log")"
if [ "${T3:-1}" != 0 ]; then
  t0=$(date +%s)
  STRATA_GPU_ATT_MMA_MIN=1 $PT tests/engine/gpu/test_gpu_models.py tests/engine/gpu/test_gpu_scheduler.py > "$OUT/t3.log" 2>&1
  echo "t3 models+scheduler (MIN=1): exit $? in $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/t3.log")"
fi
grep -E "^(FAILED|ERROR)|Error|assert" "$OUT"/t*.log | head -20
wait
for n in 512 4096; do for m in "ATT_MMA=0" "ATT_MMA=1" "ATT_MMA=2"; do
  echo -n "$m: "; env STRATA_GPU_$m python3 -m bench.engine_gpu --prefill-only $n --repeat 3 2>&1 | tail -1
done; done | tee "$OUT/ab.log"
STRATA_GPU_GRAPHS=0 STRATA_GPU_PDL=0 python3 - > "$OUT/prof.txt" 2>&1 <<'EOF'
import os
import numpy as np
import torch.profiler as tp
from engine.engine import Engine
path = "/tmp/strata-bench/qwen3moe-synth-48L-skew1.gguf"
with Engine.open(path, device="cuda:0", kv_tokens=8192, block_size=16, prefill_chunk=512) as eng:
    ids = [int(t) for t in np.random.default_rng(1).integers(0, eng.hparams.n_vocab, size=4096)]
    for mode in ("0", "2"):
        os.environ["STRATA_GPU_ATT_MMA"] = mode
        b = eng.blocks.allocate(256)
        eng.prefill(ids, b)
        eng.blocks.release(b)
        b = eng.blocks.allocate(256)
        prof = tp.profile(activities=[tp.ProfilerActivity.CUDA])
        with prof:
            eng.prefill(ids, b)
        eng.blocks.release(b)
        print(f"== prefill 4096, STRATA_GPU_ATT_MMA={mode}, graphs and PDL off")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=8, max_name_column_width=50))
EOF
grep -E "==|attention" "$OUT/prof.txt" | head -12
if [ "${NCU:-0}" = 1 ]; then
  NCUB=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  STRATA_GPU_PDL=0 timeout 150 "$NCUB" --clock-control none -k regex:k_attention_mma --launch-skip 336 --launch-count 2 \
      --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
      --section ComputeWorkloadAnalysis python3 -m bench.engine_gpu --prefill-only 4096 > "$OUT/ncu.txt" 2>&1
  echo "ncu exit $?"
  grep -E "k_attention_mma|Duration|Achieved Occupancy|Memory Throughput|Compute \(SM\) Throughput|Stall|L2 Hit" \
      "$OUT/ncu.txt" | head -30
fi
