"""Each test starts with torch's own `F.linear` / `F.embedding` and leaves them so.

`ds_zero.Init` and the stage-3 parameter manager replace `torch.nn.functional.linear` for the rest of the
process (DeepSpeed's `memory_efficient_linear`), and a quantized `Init` also wraps `F.embedding` and the
state-dict loading of `nn.Linear` / `nn.Embedding`; what one test installs must not change what the next
one runs.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from ds_comm.testing import preload_in_ranks
from ds_zero import torch_patches_restored

# Every rank of every dist test imports ZeRO's optimizers; the ranks' forkserver imports them once for all
# of them ([Note: preloading a suite's modules] in ds_comm).
preload_in_ranks("ds_zero._stage12.optimizer", "ds_zero._stage3.optimizer", "ds_zero._construct")


@pytest.fixture(autouse=True)
def _restore_torch_linear() -> Iterator[None]:
    with torch_patches_restored():
        yield


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection imported (torch, the packages, the test modules) out of garbage collection.

    Those objects live for the whole run; without the freeze every full collection walks them again
    (torch alone is a few hundred thousand objects): 4.3 s of a 39 s run of ds-engine's config, compat-API,
    precision and lr-schedule tests, 2.7 s with the freeze.
    """
    gc.collect()
    gc.freeze()
