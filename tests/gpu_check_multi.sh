#!/usr/bin/env bash
# For the first machine with two or more GPUs (tests/gpu_multi.py says what it checks): FSDP2 over 2 ranks with a
# second optimizer writing after step(), and the all-gather race one GPU cannot show; NCCL's flight recorder on
# (a hang dumps each rank's last collectives), then once more with CUDA_DEVICE_MAX_CONNECTIONS=1. At most 6 minutes.
# Usage: bash tests/gpu_check_multi.sh  (GPU_CHECK_OUT=DIR: where the JSON files go)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TORCH_NCCL_TRACE_BUFFER_SIZE=2000 TORCH_NCCL_DUMP_ON_TIMEOUT=1
out="${GPU_CHECK_OUT:-traces/gpu_check}"
export TORCH_NCCL_DEBUG_INFO_TEMP_FILE="$out/nccl_trace_rank_"
mkdir -p "$out"
rc=0
timeout 170 torchrun --standalone --nproc-per-node 2 tests/gpu_multi.py --out "$out" || rc=1
CUDA_DEVICE_MAX_CONNECTIONS=1 timeout 170 torchrun --standalone --nproc-per-node 2 tests/gpu_multi.py --out "$out" || rc=1
exit "$rc"
