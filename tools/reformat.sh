#!/usr/bin/env bash
# Apply the repository's formatting: ruff format, then ruff's safe fixes (import order among them).
# Afterwards `nox -s lint` passes its format check. Formats the whole tree; run from anywhere.
# Uses the ruff pinned in constraints.txt (another release may format differently).
set -euo pipefail
cd "$(dirname "$0")/.."
pin=$(sed -n 's/^ruff==//p' constraints.txt)
have=$(ruff --version 2>/dev/null | awk '{print $2}' || true)
if [[ "$have" != "$pin" ]]; then
    echo "reformat: need ruff $pin (constraints.txt), found '${have:-none}': pip install ruff==$pin" >&2
    exit 1
fi
ruff format .
ruff check --fix .
ruff format --check .
