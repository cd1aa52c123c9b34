#!/usr/bin/env bash
# Run 51's `free(): invalid size` at the exit of a prefill_ab process (docs/gpu-runs.md run 51): the
# checks its entry lists, cheap (~60 s on a warm machine with the bench model already built). Run on the
# GPU machine after device_run.sh's setup (e.g. DIAG=1 on default_model_call.sh b, which builds the bench
# model in the background meanwhile). Each process's exit status is printed; logs in $OUT/diag-exit.log.
#  1. HMM or not (a kernel may write pageable host memory through a stray pointer without faulting).
#  2. prefill_ab (512 tokens, 1 round) with --profile base (torch's profiler, CUPTI) and without, each
#     under faulthandler (the Python stack at SIGABRT) and glibc's malloc debug (since glibc 2.34
#     MALLOC_CHECK_ does nothing unless libc_malloc_debug.so.0 is preloaded) with PYTHONMALLOC=malloc.
#  3. compute-sanitizer memcheck of exit_abort_diag.py on the bench model's 4-layer form with
#     STRATA_GPU_COMBINE_FUSE=1 and =0 (prefill 16 / 64 / 512, decode 16 x 2, close, exit).
set -u
OUT=${OUT:-/tmp/out}
cd "$(dirname "$0")/../../.." || exit 1
log=$OUT/diag-exit.log
{
  echo "== addressing: $(nvidia-smi -q | grep -i 'addressing mode' | tr -s ' ')"
  dbg=$(ls /usr/lib/x86_64-linux-gnu/libc_malloc_debug.so.0 /lib/x86_64-linux-gnu/libc_malloc_debug.so.0 2>/dev/null | head -1)
  echo "== glibc $(ldd --version | head -1 | awk '{print $NF}'), malloc debug: ${dbg:-missing}"
  wait_model=${WAIT_MODEL:-/tmp/mb.pid}
  [ -f "$wait_model" ] && while kill -0 "$(cat "$wait_model")" 2>/dev/null; do sleep 1; done
  AB="python3 -X faulthandler -m tests.engine.gpu.prefill_ab --n 512 --repeat 1"
  for prof in "--profile base" ""; do
    t0=$(date +%s)
    env ${dbg:+LD_PRELOAD=$dbg} MALLOC_CHECK_=3 PYTHONMALLOC=malloc timeout 60 $AB $prof > /tmp/ab-diag.log 2>&1
    rc=$?
    echo "== prefill_ab ${prof:-(no profile)}: exit $rc in $(( $(date +%s) - t0 )) s"
    grep -E 'median|kernels$|Fatal|free\(\)|malloc|corrupt|File "|Aborted|Error' /tmp/ab-diag.log | head -30
  done
  cs=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
  for f in 1 0; do
    t0=$(date +%s)
    STRATA_GPU_COMBINE_FUSE=$f timeout 45 ${cs:-compute-sanitizer} --tool memcheck --print-limit 20 \
        python3 tests/engine/gpu/exit_abort_diag.py --quick > /tmp/cs-diag.log 2>&1
    rc=$?
    echo "== compute-sanitizer memcheck, COMBINE_FUSE=$f: exit $rc in $(( $(date +%s) - t0 )) s"
    grep -vE '^\s*$' /tmp/cs-diag.log | tail -12
  done
} 2>&1 | tee "$log"
