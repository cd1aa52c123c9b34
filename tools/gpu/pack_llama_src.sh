#!/usr/bin/env bash
# Make the trimmed llama.cpp source tarball that tools/gpu/build_llama_cuda.sh builds on
# the GPU machine (which cannot download): the llama.cpp vendored in the llama-cpp-python source
# distribution of the version installed in .venv, with only what llama-bench and
# llama-batched-bench need with CUDA (build files, ggml core + ggml-cpu + ggml-cuda, src, common,
# vendor, the two tools). Writes .llama/llama.cpp-<version>-trim.tar.gz (~3.3 MB; .llama/ is
# ignored by git: .gitignore).
#
#   [LLAMA_VERSION=X.Y.Z] tools/gpu/pack_llama_src.sh [SDIST.tar.gz]   (the version: .venv's by default)
set -eu
cd "$(dirname "$0")/../.."
ver=${LLAMA_VERSION:-$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('llama_cpp_python'))")}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
sdist=${1:-}
if [ -z "$sdist" ]; then
  .venv/bin/python -m pip download --no-binary :all: --no-deps -d "$work" "llama-cpp-python==$ver" >&2
  sdist=$(ls "$work"/llama_cpp_python-*.tar.gz)
fi
tar xzf "$sdist" -C "$work"
S=$(ls -d "$work"/llama_cpp_python-*/vendor/llama.cpp)
T=$work/trim/llama.cpp
mkdir -p "$T/tools" "$T/ggml/src"
cp -r "$S"/CMakeLists.txt "$S"/CMakePresets.json "$S"/LICENSE "$S"/licenses "$S"/cmake "$S"/include "$S"/src \
  "$S"/common "$S"/vendor "$T"/
cp -r "$S"/ggml/CMakeLists.txt "$S"/ggml/cmake "$S"/ggml/include "$T"/ggml/
for f in "$S"/ggml/src/*; do
  b=$(basename "$f")
  case $b in
    ggml-cpu|ggml-cuda) cp -r "$f" "$T/ggml/src/" ;;
    ggml-*) [ -d "$f" ] || cp "$f" "$T/ggml/src/" ;;  # the other backends' folders stay out
    *) cp -r "$f" "$T/ggml/src/" ;;
  esac
done
cp -r "$S"/tools/llama-bench "$S"/tools/batched-bench "$T"/tools/
cat > "$T/tools/CMakeLists.txt" <<'EOF'
# trimmed for Strata's GPU benchmark: only the two benchmark tools
find_package(Threads REQUIRED)
llama_add_compile_flags()
add_subdirectory(batched-bench)
add_subdirectory(llama-bench)
EOF
mkdir -p .llama
tar czf ".llama/llama.cpp-$ver-trim.tar.gz" -C "$work/trim" llama.cpp
ls -la ".llama/llama.cpp-$ver-trim.tar.gz"
