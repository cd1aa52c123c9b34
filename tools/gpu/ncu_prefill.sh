#!/usr/bin/env bash
# Nsight Compute on prefill (on the GPU machine, after device_run.sh's setup, e.g.
# `bash tools/gpu/device_run.sh sh "bash tools/gpu/ncu_prefill.sh"`): the prefill-form kernels of
# layer 0 of one 512-token step (q, k + v, tensor-core attention, o, router GEMM, gate/up, down:
# selected by name, so the 16-token warm-up step's bitwise and split GEMMs are skipped), and the
# attention of layer 0 of the last 512-token chunk of a 4,096-token prompt. Graphs and PDL off
# (prefill-form steps run without PDL anyway), clocks left alone (--clock-control none).
# STRATA_CUDA_LIB picks the library. Report: $OUT/ncu.txt, a summary printed.
set -u
. "$(dirname "$0")/ncu_setup.sh"
secs=(--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats
      --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section InstructionStats
      --section SchedulerStats)
# the pipe utilisation and instruction-mix tables (charts in the GUI) only with --print-details all
"$NCU" --help 2>/dev/null | grep -q -- --print-details && secs+=(--print-details all)
# the prefill form: k_linear_gemm<Q4_K (12), SW, BN 32 / 64, CS, FAST = true, RS = false>, as ncu demangles it
FAST='k_linear_gemm<(\(int\))?12, (\(bool\))?[01], (\(int\))?(32|64), (\(int\))?[124], (\(bool\))?(1|true), (\(bool\))?(0|false)>'
export STRATA_GPU_PDL=0 STRATA_GPU_GRAPHS=0
{
  echo "== 512-token prefill step, layer 0: q, k + v, attention, o, router, gate/up, down"
  timeout 240 "$NCU" --clock-control none --kernel-name-base demangled \
      -k "regex:$FAST|k_router_gemm|k_attention_mma" --launch-count 7 "${secs[@]}" \
      python3 -m bench.engine_gpu --prefill-only 512
  echo "== last 512-token chunk of a 4,096-token prompt: attention of layer 0 (7 chunks x 48 layers skipped)"
  timeout 240 "$NCU" --clock-control none --kernel-name-base demangled -k regex:k_attention_mma \
      --launch-skip 336 --launch-count 1 "${secs[@]}" python3 -m bench.engine_gpu --prefill-only 4096
} > "$OUT/ncu.txt" 2>&1
echo "ncu exit $?"
grep -E '^  [a-z_ ]+<|^  void |^  k_|^==|Duration|Registers Per Thread|Achieved Occupancy|Memory Throughput|Compute \(SM\) Throughput|Issue Slots Busy|Executed Ipc' \
    "$OUT/ncu.txt" | head -120
