#!/usr/bin/env bash
# Nsight Compute on decode at depth (on the GPU machine, after device_run.sh's setup, e.g.
# `bash tools/gpu/device_run.sh sh "bash tools/gpu/ncu_depth.sh 131072"`): the split-KV decode attention and its
# combine in one batch-1 decode step after D tokens of context (bench.engine_gpu --depth D --depth-ncu: two warm-up
# steps, then one inside cudaProfilerStart / Stop, graphs and PDL off), for the 8-bit cache and then the F16 one, so
# that the two forms' issue and memory figures sit side by side. Clocks left alone (--clock-control none).
# Report: $OUT/ncu_depth.txt.
set -u
. "$(dirname "$0")/ncu_setup.sh"
depth=${1:-131072}
secs=(--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats
      --section MemoryWorkloadAnalysis --section SchedulerStats --section ComputeWorkloadAnalysis
      --section InstructionStats)
K='regex:k_attention_split|k_attention_combine'
{
  for kv in q8_0 f16; do
    echo "== $kv cache, depth $depth: layer 0's split kernel and combine"
    timeout 280 "$NCU" --clock-control none --profile-from-start off -k "$K" --launch-count 2 "${secs[@]}" \
        python3 -m bench.engine_gpu --depth "$depth" --kv-type "$kv" --depth-steps 4 --unsplit-steps 0 --depth-ncu
  done
} > "$OUT/ncu_depth.txt" 2>&1
grep -E "^==|k_attention|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Issue Slots Busy|Registers Per|Achieved Occupancy" \
    "$OUT/ncu_depth.txt" | head -80
