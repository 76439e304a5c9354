#!/usr/bin/env bash
# The GPU check in one call: see tools/gpu_check.py (or `bash tools/gpu_check.sh --help`).
# On the GPU machine:  bash tools/gpu_check.sh            (figures and log under $OUT, else ./gpu_out)
# Anywhere:            bash tools/gpu_check.sh --dry-run  (install, import, collect, print the benchmark plan)
# PYTHON picks the interpreter (default python3: on the GPU machine, the one that holds torch).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" tools/gpu_check.py "$@"
