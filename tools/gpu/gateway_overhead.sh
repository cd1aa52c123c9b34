#!/usr/bin/env bash
# Issue 31's gateway target (added TTFT <= 3 ms median, <= 10 ms p99 per pair, every protection on) measured on a
# machine with idle cores: the GPU machine, whose 16 cores the 2-core VM lacks (docs/benchmarks.md "What the
# gateway costs"). Carry .whl (tools/gpu/fetch_wheels.sh) and .gwwhl (tools/gpu/gateway_wheels.sh), then either
#
#   bash tools/gpu/device_run.sh sh "bash tools/gpu/gateway_overhead.sh"    # after device_run.sh's whole setup
#   bash tools/gpu/gateway_overhead.sh                                      # alone: no probe, no CUDA build
#
# Alone (no PYTHONPATH set) it installs .whl into /tmp/site as device_run.sh does and builds the C engine when it
# is not built (python3 -m engine._build); the CUDA engine is not needed (the lane runs on the CPU). Then it
# installs .gwwhl's wheels into $GW_SITE (default /tmp/gwsite, ahead of /tmp/site on the import path), builds a
# model of the default model's shape, tokenizer and chat template with random weights (bench/synthetic_moe.py
# --shape default, from .gwwhl/default-meta.gguf.gz; a few seconds), and runs bench.gateway_overhead twice, each
# with a fresh lane (the CPU engine, pinned as `make run` pins lane a: the first half of the CPUs) and gateway
# (every protection on, the deployed defaults): the A/A control first (--control: the method's own noise floor on
# the machine), then the measured run with --stages. The gateway's embedding model is not installed there, so its
# retrieval is "off" (the measured request touches neither documents nor session memory). COMPARE=1 adds the A/B
# of the gateway's runtime (--compare 'event_loop="asyncio"' --compare switch_interval_ms=5); any other COMPARE is
# that A/B's bench.gateway_overhead options, split at spaces (COMPARE='--compare cores="8-15"'). N (default 300)
# pairs per run; LANE_CORES (default auto) the lane's cores ("" leaves it unpinned, the benchmark's own default).
# Back in $OUT: gw.log (every step's output), gw_control.json, gw_stages.json (and gw_compare.json).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
cd "$(dirname "$0")/../.." || exit 1
export PYTHONUNBUFFERED=1
site=${GW_SITE:-/tmp/gwsite}
whl_site=${WHL_SITE:-/tmp/site}  # alone: where .whl goes (device_run.sh's folder)
n=${N:-300}
cores=${LANE_CORES-auto}
log=$OUT/gw.log
t0=$(date +%s)
el() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$log"; }
ls .gwwhl/*.whl > /dev/null 2>&1 || { echo "no .gwwhl/*.whl: run tools/gpu/gateway_wheels.sh here and carry .gwwhl" | tee -a "$log"; exit 1; }
if [ -z "${PYTHONPATH:-}" ]; then  # not under device_run.sh: its install of .whl
  ls .whl/*.whl > /dev/null 2>&1 || { echo "no .whl/*.whl: run tools/gpu/fetch_wheels.sh here and carry .whl" | tee -a "$log"; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$whl_site" .whl/*.whl \
      >> "$log" 2>&1 || { el "pip install of .whl failed"; tail -5 "$log"; exit 1; }
  export PYTHONPATH=$whl_site:$PWD
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .gwwhl/*.whl \
    >> "$log" 2>&1 || { el "pip install of .gwwhl failed"; tail -5 "$log"; exit 1; }
export PYTHONPATH=$site:$PYTHONPATH
if ! python3 -c "import engine._strata_c" > /dev/null 2>&1; then
  python3 -m engine._build >> "$log" 2>&1 || { el "C engine build failed"; tail -20 "$log"; exit 1; }
  el "C engine built"
fi
python3 -c "import aiohttp, uvloop, tokenizers, jinja2, prometheus_client, sqlalchemy, pydantic, numpy, engine._strata_c" \
    >> "$log" 2>&1 || { el "imports fail"; tail -5 "$log"; exit 1; }
mdir=/tmp/gw-model
mkdir -p "$mdir"
model=$mdir/default-shape.gguf
gunzip -c .gwwhl/default-meta.gguf.gz > "$mdir/default-meta.gguf" || { el "cannot unpack the metadata"; exit 1; }
python3 -m bench.synthetic_moe --shape default --source "$mdir/default-meta.gguf" "$model" >> "$log" 2>&1 \
    || { el "model build failed"; tail -5 "$log"; exit 1; }
el "model $(du -h "$model" | cut -f1); $(nproc) CPUs; load $(cut -d' ' -f1-3 /proc/loadavg)"
args=(-n "$n" --model "$model")
[ -n "$cores" ] && args+=(--lane-cores "$cores")
rc=0
bench() {  # NAME, then bench.gateway_overhead's own options
  local name=$1
  shift
  local one=/tmp/gw-$name.log
  el "== $name: python3 -m bench.gateway_overhead ${args[*]} $* --json $OUT/gw_$name.json"
  if python3 -m bench.gateway_overhead "${args[@]}" "$@" --json "$OUT/gw_$name.json" > "$one" 2>&1; then
    grep -E "retrieval|^  (TTFT|total|added|CPU|load|B|gateway stages|lane's own|segments)" "$one"
  else
    rc=1
    tail -20 "$one"
    el "$name failed"
  fi
  cat "$one" >> "$log"
}
bench control --control
bench stages --stages
case "${COMPARE:-0}" in
  0) ;;
  1) bench compare --compare 'event_loop="asyncio"' --compare switch_interval_ms=5 ;;
  *) read -r -a cmp <<< "$COMPARE"; bench compare "${cmp[@]}" ;;  # bench.gateway_overhead's options, e.g. --compare cores="8-15"
esac
el "done (exit $rc)"
exit $rc
