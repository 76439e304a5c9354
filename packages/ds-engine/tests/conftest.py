"""Make the shared test helpers (`ds_engine_testkit`) importable from tests/ and tests/dist/; restore torch's
`F.linear` after each test (see `_restore_torch_linear`); split the work between the ds-engine-alone and the
all-extras CI sessions (`extras_split`: `--only-extras`, `runs_without_extras.txt`)."""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = str(Path(__file__).parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from extras_split import (  # noqa: E402 - needs HERE on sys.path
    pytest_addoption,
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_make_collect_report,
    pytest_runtest_makereport,
    pytest_runtest_protocol,
    pytest_unconfigure,
)

from ds_comm.testing import preload_in_ranks  # noqa: E402

# Every rank of every dist test imports the stack under test; the ranks' forkserver imports it once for all
# of them ([Note: preloading a suite's modules]). What is not installed (ds-engine alone) is skipped there.
preload_in_ranks(
    "ds_engine._setup.initialize",
    "ds_engine._engine.engine",
    "ds_engine._pipeline",
    "ds_zero._stage12.optimizer",
    "ds_zero._stage3.optimizer",
    "ds_parallel",
    "transformers.modeling_utils",
    "transformers.models.auto.modeling_auto",
    "transformers.models.llama.modeling_llama",
    "transformers.models.mixtral.modeling_mixtral",
)

# Looked up once, here, before `extras_split` starts watching: every test uses it, and the lookup is the
# conftest's, not the test's.
try:
    from ds_zero import torch_patches_restored
except ImportError:  # ds-engine alone: nothing installs anything
    torch_patches_restored = None

__all__ = [
    "pytest_addoption",
    "pytest_collection_modifyitems",
    "pytest_configure",
    "pytest_make_collect_report",
    "pytest_runtest_makereport",
    "pytest_runtest_protocol",
    "pytest_unconfigure",
]


@pytest.fixture(autouse=True)
def _restore_torch_linear() -> Iterator[None]:
    """Each test starts with torch's own `F.linear` / `F.embedding` and leaves them so.

    With ds-zero installed, `zero.Init` and stage 3 replace `torch.nn.functional.linear` for the rest of
    the process (DeepSpeed's `memory_efficient_linear`), and a quantized `Init` also wraps `F.embedding`
    and the state-dict loading of `nn.Linear` / `nn.Embedding`; one test's install must not leak into the next.
    """
    if torch_patches_restored is None:  # ds-engine alone: nothing installs anything
        yield
        return
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
