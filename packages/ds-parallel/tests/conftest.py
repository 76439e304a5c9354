"""Make the shared test helpers (`tiny_hf`) importable from tests/ and tests/dist/."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = str(Path(__file__).parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
