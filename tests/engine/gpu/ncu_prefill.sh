#!/usr/bin/env bash
# Nsight Compute on prefill (run by session_call.sh ncu on the GPU machine, after device_run.sh's
# setup): the k_linear_gemm / k_group launches of layer 0 of one 512-token prefill step (the
# warm-up step of 16 tokens uses neither), and the query-tile attention of layers 0-1 of the
# last 512-token chunk of a 4,096-token prompt (7 chunks x 48 layers skipped). PDL off, so
# each kernel's time is its own; clocks left alone (--clock-control none). Report: $OUT/ncu.txt.
set -u
. "$(dirname "$0")/ncu_setup.sh"
secs=(--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats
      --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section InstructionStats
      --section SchedulerStats)
# the pipe utilisation and instruction-mix tables (charts in the GUI) only with --print-details all
"$NCU" --help 2>/dev/null | grep -q -- --print-details && secs+=(--print-details all)
{
  echo "== 512-token prefill step: GEMMs and grouping of layer 0 (+ layer 1's q), GEMM tile list on"
  STRATA_GPU_PDL=0 STRATA_GPU_GEMM_TILES=1 timeout 240 "$NCU" --clock-control none -k 'regex:k_linear_gemm|k_group' \
      --launch-count 8 "${secs[@]}" python3 -m bench.engine_gpu --prefill-only 512
  echo "== last 512-token chunk of a 4,096-token prompt: query-tile attention, layers 0-1"
  STRATA_GPU_PDL=0 STRATA_GPU_ATT_TILE=1 timeout 240 "$NCU" --clock-control none -k regex:k_attention_tile \
      --launch-skip 336 --launch-count 2 "${secs[@]}" python3 -m bench.engine_gpu --prefill-only 4096
} > "$OUT/ncu.txt" 2>&1
echo "ncu exit $?"
grep -E '^  [a-z_]+<|^  k_|Duration|Registers Per Thread|Theoretical Occupancy|Achieved Occupancy|Memory Throughput|Compute \(SM\) Throughput' \
    "$OUT/ncu.txt" | head -90
