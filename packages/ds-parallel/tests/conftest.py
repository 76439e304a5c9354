"""Make the shared test helpers (`tiny_hf`) importable from tests/ and tests/dist/; preload the ranks' imports."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = str(Path(__file__).parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from ds_comm.testing import preload_in_ranks  # noqa: E402

# Every rank of every dist test imports the stack under test; the ranks' forkserver imports it once for all
# of them ([Note: preloading a suite's modules] in ds_comm). transformers is skipped where not installed.
preload_in_ranks(
    "ds_parallel",
    "ds_parallel.moe",
    "transformers.modeling_utils",
    "transformers.models.auto.modeling_auto",
    "transformers.models.llama.modeling_llama",
)
