#!/usr/bin/env bash
# Runs every benchmark against the build in $1 (default: build).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
.venv/bin/python bench/train_vs_eager.py --loom "$BUILD/bin/loom"
.venv/bin/python bench/async_checkpoint.py --loom "$BUILD/bin/loom"
.venv/bin/python bench/fsdp_vs_fsdp2.py --loom "$BUILD/bin/loom"
.venv/bin/python bench/tp_vs_pytorch_tp.py --loom "$BUILD/bin/loom"
"$BUILD/bin/loom_plan_report"
.venv/bin/python bench/lora_adapter_checkpoint.py --loom "$BUILD/bin/loom"
.venv/bin/python bench/rl_policies.py --loom "$BUILD/bin/loom"
.venv/bin/python bench/loader.py --loom "$BUILD/bin/loom"
