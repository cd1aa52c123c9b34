# The next 32-sequence decode call's steps (session 10's b32r2 engineer; docs/gpu-runs.md run 62 (b32r2)), run on
# the GPU machine after device_run.sh's setup through b32_call.sh (carry `.whl` and `.b32`):
#   HEAD=<HEAD's sm_90 build in .b32> STEPS='NS=<the n-split build in .b32> bash tests/engine/gpu/b32r2_steps.sh' \
#       bash tests/engine/gpu/b32_call.sh
# NS: a build of the tree with tests/engine/gpu/b32_nsplit_candidate.patch applied (the kernel test's hunk
# too: `git apply` it, build, keep the test file changed for this call only). Warm machine ~150-180 s:
# 1. Nsight Compute of HEAD's 32-sequence layer 0 (each kernel, warp stall ratios, SourceCounters; report kept,
#    SASS-level stall samples as CSV) and of the output head's GEMM -> $OUT/ncu32.txt, ncu_head.txt, sass.csv.gz;
# 2. the n-split form's kernel test and knob_bitwise STRATA_GPU_GEMM_NSPLIT 0 vs 3 at 24 and 32 sequences;
# 3. one --decode-only --lean process of NS (its default rows, then NSPLIT 1 / 3 / 2 at 32 and 3 at 24) and one
#    ncu pass over layer 0's GEMMs with NSPLIT=3.
set -u
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
. tests/engine/gpu/ncu_setup.sh; el "setup (model)"
M='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio'
secs=(--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats
      --section MemoryWorkloadAnalysis --section SchedulerStats --section SourceCounters)
K='regex:k_linear|k_rmsnorm|k_attention|k_route|k_quant|k_ksplit'
( export STRATA_GPU_PDL=0 STRATA_GPU_GRAPHS=0
  timeout 100 "$NCU" --clock-control none --profile-from-start off -k "$K" --launch-count 14 "${secs[@]}" --metrics "$M" \
    -o /tmp/l32 python3 -m bench.engine_gpu --ncu-step 32 > $OUT/l32.log 2>&1; el "ncu 32 exit $?"
  "$NCU" --import /tmp/l32.ncu-rep > $OUT/ncu32.txt 2>&1
  timeout 30 "$NCU" --import /tmp/l32.ncu-rep --page source --print-source sass --csv 2>&1 | gzip > $OUT/sass.csv.gz
  timeout 60 "$NCU" --clock-control none --profile-from-start off --kernel-name-base demangled \
    -k 'regex:k_linear_gemm<(\(int\))?14,' --launch-count 1 "${secs[@]}" --metrics "$M" \
    python3 -m bench.engine_gpu --ncu-step 32 > $OUT/ncu_head.txt 2>&1; el "ncu head exit $?" )
grep -E '^  [a-z_]+<|^  k_|Duration|Warp Cycles Per Issued|Achieved Active Warps|stalled_(barrier|long|short|wait|math|mio|not_sel|lg)' \
    $OUT/ncu32.txt | head -120
[ -n "${NS:-}" ] || exit 0
F=$L/$NS.so
STRATA_CUDA_LIB=$F python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/engine/gpu/test_gpu_kernels.py \
  -k "routed_gemm_tiles" > $OUT/tests.log 2>&1; el "tests exit $?: $(tail -1 $OUT/tests.log)"
STRATA_CUDA_LIB=$F python3 tests/engine/gpu/knob_bitwise.py STRATA_GPU_GEMM_NSPLIT --values 0,3 --seqs 24,32 2>&1 \
  | grep -E "sequences|rror" | tee $OUT/kb.log; el kb
STRATA_CUDA_LIB=$F python3 -m bench.engine_gpu --decode-only --lean --knob 32:STRATA_GPU_GEMM_NSPLIT=1 \
  --knob 32:STRATA_GPU_GEMM_NSPLIT=3 --knob 32:STRATA_GPU_GEMM_NSPLIT=2 --knob 24:STRATA_GPU_GEMM_NSPLIT=3 2>&1 \
  | grep '^decode (' | tee $OUT/bench.log; el bench
( export STRATA_GPU_PDL=0 STRATA_GPU_GRAPHS=0 STRATA_GPU_GEMM_NSPLIT=3 STRATA_CUDA_LIB=$F
  timeout 60 "$NCU" --clock-control none --profile-from-start off -k 'regex:k_linear_gemm' --launch-count 4 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --metrics "$M" \
    python3 -m bench.engine_gpu --ncu-step 32 > $OUT/ncu32_ns.txt 2>&1; el "ncu ns exit $?" )
grep -E '^  k_|Duration|Registers Per|Achieved Active Warps' $OUT/ncu32_ns.txt | head -40
