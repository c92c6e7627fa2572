#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (baseline B of the serving benchmark) from source.
#
# The source is the llama.cpp tree vendored in the `llama-cpp-python` sdist, fetched with
# pip from PyPI (no git, no model hub); it is built with cmake, CPU only, native
# instructions, no web UI (whose prebuilt assets would be downloaded), no TLS, into
# .cache/llama.cpp/ (git-ignored). A second run finds the binary and does nothing.
#
#   scripts/build_llama_server.sh            # prints the path of the binary
#   LLAMA_CPP_PYTHON_VERSION=0.3.36 JOBS=2 scripts/build_llama_server.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
ROOT=".cache/llama.cpp/$VERSION"
BIN="$ROOT/build/bin/llama-server"
JOBS="${JOBS:-$(nproc)}"
PIP="${PIP:-.venv/bin/pip}"
if [ -x "$BIN" ]; then
  echo "$BIN"
  exit 0
fi
mkdir -p "$ROOT"
if [ ! -d "$ROOT/src" ]; then
  echo "fetching the llama-cpp-python $VERSION sdist from PyPI ..." >&2
  "$PIP" download --quiet --no-deps --no-binary :all: --no-build-isolation "llama-cpp-python==$VERSION" -d "$ROOT/sdist" >&2 \
    || "$PIP" download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$ROOT/sdist" >&2
  tar -xzf "$ROOT"/sdist/llama_cpp_python-"$VERSION".tar.gz -C "$ROOT"
  mv "$ROOT/llama_cpp_python-$VERSION/vendor/llama.cpp" "$ROOT/src"
  rm -rf "$ROOT/llama_cpp_python-$VERSION" "$ROOT/sdist"
fi
echo "building llama-server with $JOBS jobs ..." >&2
cmake -S "$ROOT/src" -B "$ROOT/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DLLAMA_LLGUIDANCE=OFF >&2
cmake --build "$ROOT/build" --target llama-server -j "$JOBS" >&2
echo "$BIN"
