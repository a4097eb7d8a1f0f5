#!/usr/bin/env bash
# Installs the llama.cpp peer of `hotswap bench` into its own virtual environment:
# llama-cpp-python built from source for this CPU (-march=native), plus llama.cpp's own
# GGUF writer (`gguf`) that converts the HF checkpoint. About 20 minutes on 2 cores.
# Never run in CI: `hotswap bench` only uses the peer when this venv exists.
#
#   bash benchmarks/peers/setup_llama_cpp.sh [VENV_DIR]   # default benchmarks/peers/.venv-llama_cpp
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${1:-$here/.venv-llama_cpp}"
python="${PYTHON:-python3}"

"$python" -m venv "$venv"
"$venv/bin/pip" install --upgrade pip
"$venv/bin/pip" install numpy safetensors gguf==0.19.0
# LLAVA_BUILD=OFF: the multimodal library is loaded lazily and never used here; it only
# adds compile time. The parallel level stays at the core count so the box stays usable.
CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF ${CMAKE_ARGS:-}" \
  CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
  "$venv/bin/pip" install -v --no-binary llama-cpp-python llama-cpp-python==0.3.36
"$venv/bin/python" -c "import llama_cpp, gguf; print('llama_cpp', llama_cpp.__version__, 'ready in', '$venv')"
