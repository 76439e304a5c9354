#!/usr/bin/env bash
# Apply the repository's formatting: ruff format, then ruff's safe fixes (import order among them).
# Afterwards `nox -s lint` passes its format check. Run from anywhere; it formats the whole tree.
set -euo pipefail
cd "$(dirname "$0")/.."
ruff format .
ruff check --fix .
ruff format --check .
