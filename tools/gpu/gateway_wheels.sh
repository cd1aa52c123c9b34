#!/usr/bin/env bash
# Fill .gwwhl/ (ignored by git: .gitignore) with what tools/gpu/gateway_overhead.sh needs on the GPU machine
# beyond .whl/ (tools/gpu/fetch_wheels.sh) and the image (Python 3.12 with numpy, torch, transformers): the
# gateway's and the lane's serving packages at the versions requirements/run.txt locks (cp312 x86-64 wheels),
# and the default model's metadata (tokenizer, chat template, shape keys; no tensors, gzipped), from which the
# device builds a model of the default model's shape and vocabulary (bench/synthetic_moe.py --shape default)
# in place of the 427 MB model and its 98 MB package, which cannot be carried. ~11.5 MB in all.
#
#   tools/gpu/gateway_wheels.sh            # from the repository root; PYTHON (default .venv/bin/python, else
#                                          # python3) writes the metadata and needs the default model
set -eu
cd "$(dirname "$0")/../.."
# what the gateway and the lane import that .whl/ lacks (aiohttp and its dependencies, jinja2 for the chat
# template, tokenizers for the gateway's own prompt count, prometheus-client, uvloop: the gateway's deployed event
# loop); carried even where the image may hold another version, so that the measured code runs on the locked ones
want="aiohttp aiohappyeyeballs aiosignal attrs frozenlist multidict propcache yarl idna jinja2 markupsafe
      prometheus-client tokenizers uvloop"
pins=()
for n in $want; do
  line=$(grep -iE "^${n}==" requirements/run.txt | head -1)
  [ -n "$line" ] || { echo "gateway_wheels: $n is not pinned in requirements/run.txt" >&2; exit 1; }
  pins+=("${line%% *}")
done
py=${PYTHON:-}
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$py" -m pip download -q --only-binary=:all: --no-deps --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$tmp" "${pins[@]}" 2>&1 | grep -v '^WARNING: Location' || true
rm -rf .gwwhl
mkdir -p .gwwhl
for pin in "${pins[@]}"; do
  name=${pin%%==*}
  ver=${pin##*==}
  file=$(echo "$name" | tr 'A-Z-' 'a-z_')
  f=$(ls "$tmp"/"$file"-"$ver"-*.whl 2>/dev/null | head -1)
  [ -n "$f" ] || { echo "gateway_wheels: $pin was not downloaded" >&2; exit 1; }
  cp "$f" .gwwhl/
done
PYTHONPATH=$PWD "$py" -m bench.synthetic_moe --metadata-only "$tmp/default-meta.gguf" > /dev/null
gzip -9 -c "$tmp/default-meta.gguf" > .gwwhl/default-meta.gguf.gz
ls .gwwhl
du -sh .gwwhl
