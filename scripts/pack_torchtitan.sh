#!/usr/bin/env bash
# Downloads TorchTitan 0.3.0 and the pure-Python packages it imports (not torch: the GPU machine
# has its own CUDA torch, and TorchTitan 0.3.0 asks for torch >= 2.11 through torch_checkpointing)
# into .device/torchtitan/, which the GPU machine cannot download (no registry). Run here, from the
# project root, after ../shared/gpu/pack.sh; carry .device. scripts/gpu_check.sh unpacks the
# wheels onto PYTHONPATH and runs bench/torchtitan_vs_loom.py with them (issue 49).
# torchao: TorchTitan's Float8 converters use it (its compiled extras may not match the machine's
# torch; the Float8 training path is Python over torch._scaled_mm).
set -euo pipefail
dest=.device/torchtitan
mkdir -p "$dest"
PIP=${PIP:-.venv/bin/pip}
"$PIP" download --no-deps --only-binary=:all: -d "$dest" \
  torchtitan==0.3.0 spmd_types==0.2.3 torch_checkpointing==0.1.1 torchdata==0.11.0 tyro==1.0.17 \
  docstring-parser==0.18.0 typeguard==4.6.1 typing_extensions==4.15.0 einops==0.8.2 torchao==0.18.0
du -sh "$dest"
