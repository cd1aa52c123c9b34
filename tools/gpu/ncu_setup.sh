# shellcheck shell=bash
# Sourced by ncu_decode.sh and ncu_prefill.sh (on the GPU machine, after device_run.sh's setup):
# OUT (default /tmp/out), NCU (Nsight Compute's command line; the script exits when there is none)
# and the bench's synthetic model, built once before any kernel is profiled.
OUT=${OUT:-/tmp/out}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "ncu: not found"; exit 1; }
python3 -m bench.engine_gpu --build-only > /tmp/model-build.log 2>&1 || { tail -5 /tmp/model-build.log; exit 1; }
