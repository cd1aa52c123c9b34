#!/usr/bin/env bash
# Nsight Compute on decode (on the GPU machine, after device_run.sh's setup, e.g.
# `bash tools/gpu/device_run.sh sh "bash tools/gpu/ncu_decode.sh"`): the kernels of
# layer 0 of one decode step at batch 1 and at 32 sequences (bench.engine_gpu --ncu-step N: two
# warm-up steps, then one inside cudaProfilerStart / Stop), and the output head's GEMM of the
# 32-sequence step. Graphs and PDL off, so each kernel is its own launch and its time its own;
# clocks left alone (--clock-control none). STRATA_CUDA_LIB picks the library. Report:
# $OUT/ncu_decode.txt, a summary printed.
set -u
. "$(dirname "$0")/ncu_setup.sh"
secs=(--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats
      --section MemoryWorkloadAnalysis --section SchedulerStats)
K='regex:k_linear|k_rmsnorm|k_attention|k_route|k_quant|k_ksplit'
export STRATA_GPU_PDL=0 STRATA_GPU_GRAPHS=0
{
  echo "== batch 1: layer 0 of one decode step (rmsnorm, q/k/v, attention, o, rmsnorm, router, gate/up, quant, down)"
  timeout 200 "$NCU" --clock-control none --profile-from-start off -k "$K" --launch-count 10 "${secs[@]}" \
      python3 -m bench.engine_gpu --ncu-step 1
  echo "== 32 sequences: layer 0 of one decode step"
  timeout 200 "$NCU" --clock-control none --profile-from-start off -k "$K" --launch-count 14 "${secs[@]}" \
      python3 -m bench.engine_gpu --ncu-step 32
  echo "== 32 sequences: the output head (Q6_K GEMM)"
  timeout 200 "$NCU" --clock-control none --profile-from-start off --kernel-name-base demangled \
      -k 'regex:k_linear_gemm<(\(int\))?14,' --launch-count 1 "${secs[@]}" python3 -m bench.engine_gpu --ncu-step 32
} > "$OUT/ncu_decode.txt" 2>&1
echo "ncu exit $?"
grep -E '^  [a-z_]+<|^  k_|^==|Duration|Registers Per Thread|Achieved Occupancy|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Issue Slots Busy' \
    "$OUT/ncu_decode.txt" | head -150
