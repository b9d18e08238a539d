#!/usr/bin/env bash
# GPU checks in one prepared run (< 5 minutes on one GPU): the CUDA-only tests, NS vs torch.bmm in bf16, the
# exposed optimizer fraction of a 12-layer d2048 model with a timeline picture, and the scale checks (warm-up over
# NCCL, the two-hop exchange on device tensors); one JSON file and a table.
# Usage on a machine with a CUDA GPU and the project installed: bash tests/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
timeout 290 python tests/gpu_check.py --device cuda --out traces/gpu_check
