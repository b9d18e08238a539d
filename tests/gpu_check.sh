#!/usr/bin/env bash
# GPU checks in one prepared run (< 5 minutes): the CUDA-only tests, then a short overlap benchmark.
# Usage on a machine with a CUDA GPU and the project installed: bash tests/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
python - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0))
PY
timeout 240 python -m pytest -q -rs tests/test_cuda.py -p no:cacheprovider
status=$?
timeout 60 python -m overlap_muon.bench --quick --cases ns,overhead 2>&1 | tail -20 || true
exit $status
