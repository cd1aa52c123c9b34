#!/usr/bin/env bash
# Fill .whl/ (ignored by git: .gitignore) with the Python packages the GPU machine's image lacks, for Python
# 3.12 on x86-64 (tools/gpu/README.md: device_run.sh installs them with --no-deps). A fresh
# checkout has no .whl/: run this once before the first device call. The image has numpy, torch,
# transformers, aiohttp, jinja2, tokenizers, prometheus-client, pytest-xdist and the rest; these are
# the serving dependencies it lacks (pyproject), pytest-asyncio with the pytest it needs, and what
# pydantic needs at the versions pip resolves together.
set -eu
cd "$(dirname "$0")/../.."
want="annotated_types cffi gguf iniconfig llguidance pluggy pycparser pydantic pydantic_core pytest
      pytest_asyncio sqlalchemy supervisor typing_extensions typing_inspection"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$tmp" cffi gguf 'pydantic>=2.7,<3' pytest-asyncio 'supervisor>=4.2,<5' 'sqlalchemy>=2.0,<3' \
  'llguidance>=1.2,<2' 2>&1 | grep -v '^WARNING: Location' || true
mkdir -p .whl
for n in $want; do
  f=$(ls "$tmp"/"$n"-[0-9]*.whl 2>/dev/null | head -1)
  [ -n "$f" ] || { echo "fetch_wheels: $n was not downloaded" >&2; exit 1; }
  rm -f .whl/"$n"-[0-9]*.whl
  cp "$f" .whl/
done
du -sh .whl
