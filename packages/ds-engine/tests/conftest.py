"""Make the shared test helpers (`ds_engine_testkit`) importable from tests/ and tests/dist/; restore torch's
`F.linear` after each test (see `_restore_torch_linear`)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = str(Path(__file__).parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)


@pytest.fixture(autouse=True)
def _restore_torch_linear() -> Iterator[None]:
    """Each test starts with torch's own `F.linear` / `F.embedding` and leaves them so.

    With ds-zero installed, `zero.Init` and stage 3 replace `torch.nn.functional.linear` for the rest of
    the process (DeepSpeed's `memory_efficient_linear`), and a quantized `Init` also wraps `F.embedding`
    and the state-dict loading of `nn.Linear` / `nn.Embedding`; one test's install must not leak into the next.
    """
    try:
        from ds_zero import torch_patches_restored
    except ImportError:  # ds-engine alone: nothing installs anything
        yield
        return
    with torch_patches_restored():
        yield
