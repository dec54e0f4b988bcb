#!/usr/bin/env bash
# Builds llama.cpp's C++ server (llama-server) from the llama.cpp source vendored in llama-cpp-python's sdist, the
# same llama.cpp that `make bench-peers` installs as a Python package, and installs it as $VENV/bin/llama-server.
# Only PyPI is reached (the sdist): the web UI is neither built nor downloaded (LLAMA_BUILD_UI=OFF,
# LLAMA_USE_PREBUILT_UI=OFF: the server embeds an empty UI), no curl (LLAMA_CURL=OFF; this llama.cpp no longer links
# it) and no HTTPS client (LLAMA_OPENSSL=OFF). Sources and objects stay under build/llama-server (ignored by git);
# a second run rebuilds only what changed. About 10 minutes on 2 quiet cores (JOBS=N to change -j).
# Usage: scripts/build_llama_server.sh [VENV]   (default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
VERSION=0.3.36
WORK=build/llama-server
JOBS=${JOBS:-$(nproc)}
mkdir -p "$WORK"
if [ ! -d "$WORK/src/vendor/llama.cpp" ]; then
  "$VENV/bin/pip" download -q --no-binary :all: --no-deps -d "$WORK" "llama-cpp-python==$VERSION"
  rm -rf "$WORK/src" && mkdir -p "$WORK/src"
  tar -xzf "$WORK/llama_cpp_python-$VERSION.tar.gz" -C "$WORK/src" --strip-components=1
fi
# The CPU flags of bench-peers' llama-cpp-python: AVX2/FMA/F16C, AVX-512 where the CPU has it, no AMX.
AVX512=$(grep -q avx512f /proc/cpuinfo && echo ON || echo OFF)
cmake -S "$WORK/src/vendor/llama.cpp" -B "$WORK/cmake" -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF \
  -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512="$AVX512" \
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
cmake --build "$WORK/cmake" --target llama-server -j "$JOBS"
install -m 755 "$WORK/cmake/bin/llama-server" "$VENV/bin/llama-server"
"$VENV/bin/llama-server" --version
