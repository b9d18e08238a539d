#!/usr/bin/env bash
# GPU checks in one prepared run, reporting whatever happens (tests/gpu_check.py lists the sections and their
# budgets): the JSON is rewritten after every section and each section prints a progress line, so a run cut by the
# timeout below leaves what it measured. Without a GPU it prints "no GPU", writes the JSON and exits 0.
# Usage on a machine with a CUDA GPU and the project installed: bash tests/gpu_check.sh  (at most 9 minutes)
# GPU_CHECK_OUT=DIR writes the JSON (gpu_check.json) and traces there instead of traces/gpu_check.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
out="${GPU_CHECK_OUT:-traces/gpu_check}"
timeout 540 python tests/gpu_check.py --device cuda --out "$out"
rc=$?
if [ "$rc" -eq 124 ]; then echo "gpu_check: cut by the 540 s timeout; $out/gpu_check.json holds the sections that ended"; fi
exit "$rc"
