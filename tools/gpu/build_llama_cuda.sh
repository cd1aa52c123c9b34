#!/usr/bin/env bash
# Build llama.cpp's llama-bench and llama-batched-bench with CUDA on the GPU machine, for the
# peer column of bench/engine_gpu.py (tools/gpu/README.md). The source is the llama.cpp vendored in
# the llama-cpp-python source distribution of the version in .venv, carried as a trimmed tarball
# (.llama/, ignored by git; made by pack_llama_src.sh).
#
#   build_llama_cuda.sh SRC.tar.gz BUILD_DIR [PACK_DIR]   build (make SRC with pack_llama_src.sh)
#   build_llama_cuda.sh PACK_DIR BUILD_DIR                unpack binaries an earlier call packed
#
# Also on a machine without a GPU (nvcc and cmake suffice): CUBLAS_LIB_DIR names a cuBLAS lib folder
# (an unpacked `nvidia-cublas` 13.0 wheel's nvidia/cu13/lib, its include/ beside it); build into
# /tmp/llama-build with a PACK_DIR and carry that as .llama/bin-pack (the GPU machine's toolkit
# has libcublas.so.13 in /usr/local/cuda/lib64, which the binaries' run path names).
#
# Shared libraries, so that the binaries can come back through $OUT in a few pieces (PACK_DIR:
# llama-bin.tar.xz split into 15 MiB parts) and be carried into a later call instead of rebuilt
# (unpacked to the same BUILD_DIR: their run path points there). Prints one line: where the
# binaries are, or why not.
set -u
src=${1:?source tarball}; b=${2:?build dir}; pack=${3:-}
if [ -x "$b/bin/llama-bench" ] && [ -x "$b/bin/llama-batched-bench" ]; then
  echo "llama.cpp: already built in $b"; exit 0
fi
if [ -d "$src" ]; then
  ls "$src"/llama-bin.tar.xz.part-* >/dev/null 2>&1 || { echo "llama.cpp: no packed binaries in $src"; exit 1; }
  mkdir -p "$b" && cat "$src"/llama-bin.tar.xz.part-* | tar xJf - -C "$b" \
    && [ -x "$b/bin/llama-bench" ] && echo "llama.cpp: unpacked into $b" && exit 0
  echo "llama.cpp: cannot unpack $src"; exit 1
fi
command -v cmake >/dev/null && command -v nvcc >/dev/null || { echo "llama.cpp: no cmake or nvcc"; exit 1; }
s=$(mktemp -d)
tar xzf "$src" -C "$s" || { echo "llama.cpp: cannot unpack $src"; exit 1; }
extra=()
# cuBLAS: the toolkit's if it has one, else the pip package torch uses (nvidia-cublas)
if ! ls /usr/local/cuda/lib64/libcublas.so >/dev/null 2>&1; then
  lib=${CUBLAS_LIB_DIR:-}
  [ -n "$lib" ] || lib=$(python3 - <<'EOF'
import glob, os, site
roots = site.getsitepackages() + [site.getusersitepackages()]
hits = [p for r in roots for p in glob.glob(os.path.join(r, "nvidia", "**", "libcublas.so*"), recursive=True)]
print(os.path.dirname(sorted(hits)[0]) if hits else "")
EOF
)
  [ -n "$lib" ] || { echo "llama.cpp: no cuBLAS found (toolkit or pip)"; exit 1; }
  inc=$(dirname "$lib")/include
  c=$(mktemp -d)
  for n in cublas cublasLt; do ln -sf "$(ls "$lib"/lib$n.so* | head -1)" "$c/lib$n.so"; done
  extra+=("-DCUDA_cublas_LIBRARY=$c/libcublas.so" "-DCUDA_cublasLt_LIBRARY=$c/libcublasLt.so"
          "-DCMAKE_CXX_FLAGS=-I$inc" "-DCMAKE_CUDA_FLAGS=-I$inc" "-DCMAKE_BUILD_RPATH=$lib;/usr/local/cuda/lib64")
  echo "cuBLAS from $lib" >&2
fi
# No driver here (a machine without a GPU): link against a stub libcuda.so.1 that defines every driver
# entry point cuda.h declares (macro-renamed ones as the headers rename them); the GPU machine's real
# libcuda.so.1 is found at run time.
if ! ldconfig -p | grep -q 'libcuda\.so\.1' && ! ls /usr/local/cuda/lib64/stubs/libcuda.so >/dev/null 2>&1; then
  st=$(mktemp -d)
  h=$(dirname "$(ls /usr/local/cuda/include/cuda.h /usr/local/cuda-*/include/cuda.h "$(dirname "$(command -v nvcc)")"/../include/cuda.h 2>/dev/null | head -1)")
  grep -oE "CUDAAPI cu[A-Za-z0-9_]+\(" "$h/cuda.h" | sed -E 's/CUDAAPI (.*)\(/STRATA_SYM \1/' | sort -u \
    | { echo '#include <cuda.h>'; cat; } > "$st/names.c"
  gcc -E -I"$h" "$st/names.c" | awk '$1 == "STRATA_SYM" {print "void " $2 "(void) {}"}' | sort -u > "$st/stub.c"
  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$st/libcuda.so" "$st/stub.c" && ln -s libcuda.so "$st/libcuda.so.1" \
    || { echo "llama.cpp: cannot make a driver stub"; exit 1; }
  extra+=("-DCUDA_cuda_driver_LIBRARY=$st/libcuda.so")
  echo "driver stub $st/libcuda.so ($(wc -l < "$st/stub.c") entry points)" >&2
fi
t0=$(date +%s)
cmake -S "$s/llama.cpp" -B "$b" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
  -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real -DGGML_NATIVE=ON \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF "${extra[@]}" >&2 \
  || { echo "llama.cpp: cmake configure failed"; exit 1; }
cmake --build "$b" --target llama-bench llama-batched-bench -j "$(nproc)" >&2 \
  || { echo "llama.cpp: build failed"; exit 1; }
echo "llama.cpp: built in $b in $(( $(date +%s) - t0 )) s"
if [ -n "$pack" ]; then
  mkdir -p "$pack"
  (cd "$b" && XZ_OPT="-T0 -6" tar cJf - bin/llama-bench bin/llama-batched-bench $(find bin -name '*.so*')) \
    | split -b 15M - "$pack/llama-bin.tar.xz.part-"
  ls -la "$pack" >&2
fi
