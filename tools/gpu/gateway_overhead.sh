#!/usr/bin/env bash
# Issue 31's gateway target (added TTFT <= 3 ms median, <= 10 ms p99 per pair, every protection on) measured on a
# machine with idle cores: the GPU machine, whose 16 cores the 2-core VM lacks (docs/benchmarks.md "What the
# gateway costs"). Run after device_run.sh's setup (its wheels in /tmp/site, the C engine built), carrying .whl
# and .gwwhl (tools/gpu/gateway_wheels.sh):
#
#   bash tools/gpu/device_run.sh sh "bash tools/gpu/gateway_overhead.sh"
#
# It installs .gwwhl's wheels into $GW_SITE (default /tmp/gwsite, ahead of /tmp/site on the import path), builds
# a model of the default model's shape, tokenizer and chat template with random weights
# (bench/synthetic_moe.py --shape default, from .gwwhl/default-meta.gguf.gz; ~5 s), then runs
# bench.gateway_overhead twice, each with a fresh lane (CPU engine, pinned as `make run` pins lane a: the first
# half of the CPUs) and gateway: the A/A control first (--control: the method's own noise floor on the machine),
# then the measured run with --stages. The gateway's embedding model is not installed there, so its retrieval
# is "off" (the measured request touches neither documents nor session memory). COMPARE=1 adds the A/B of the
# gateway's runtime (--compare 'event_loop="asyncio"' --compare switch_interval_ms=5). N (default 300) pairs per
# run; LANE_CORES (default auto) the lane's cores ("" leaves it unpinned, the script's own default).
# Back in $OUT: gw.log (every step's output), gw_control.json, gw_stages.json (and gw_compare.json).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
cd "$(dirname "$0")/../.." || exit 1
export PYTHONUNBUFFERED=1
site=${GW_SITE:-/tmp/gwsite}
n=${N:-300}
cores=${LANE_CORES-auto}
log=$OUT/gw.log
t0=$(date +%s)
el() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$log"; }
ls .gwwhl/*.whl > /dev/null 2>&1 || { echo "no .gwwhl/*.whl: run tools/gpu/gateway_wheels.sh here and carry .gwwhl" | tee -a "$log"; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .gwwhl/*.whl \
    >> "$log" 2>&1 || { el "pip install of .gwwhl failed"; tail -5 "$log"; exit 1; }
export PYTHONPATH=$site:${PYTHONPATH:-$PWD}
python3 -c "import aiohttp, uvloop, tokenizers, jinja2, prometheus_client, sqlalchemy, pydantic, numpy, engine._strata_c" \
    >> "$log" 2>&1 || { el "imports fail (device_run.sh's setup: .whl in /tmp/site, the C engine built?)"; tail -5 "$log"; exit 1; }
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
if [ "${COMPARE:-0}" = 1 ]; then
  bench compare --compare 'event_loop="asyncio"' --compare switch_interval_ms=5
fi
el "done (exit $rc)"
exit $rc
