#!/usr/bin/env bash
# TensorRT check for a machine with an NVIDIA GPU (see check_tensorrt.py). Installs nothing: the
# machine needs the project installed (pip install -e '.[host,tensorrt]') plus a CUDA build of torch.
# Usage: hil/gpu/check_tensorrt.sh [--workdir DIR] [--model M.onnx --calib C.npz --eval E.npz]
set -euo pipefail
cd "$(dirname "$0")/../.."
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv,noheader
else
    echo "check_tensorrt: nvidia-smi not found (Jetson boards have none; continuing)" >&2
fi
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "${PYTHON:-python3}" hil/gpu/check_tensorrt.py "$@"
