"""Shared fixtures: one JIT cache for the whole session, so each op compiles once per test run."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def session_extensions_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Point TORCH_EXTENSIONS_DIR at a fresh folder for the session (subprocesses inherit it).

    `DS_OPS_TEST_EXTENSIONS_DIR` names a folder to use instead: tools/gpu_check.py sets it to where
    its build_ops step just compiled (and timed) the ops, so the CUDA tests do not compile them again.
    """
    configured = os.environ.get("DS_OPS_TEST_EXTENSIONS_DIR")
    path = Path(configured) if configured else tmp_path_factory.mktemp("torch_extensions")
    patch = pytest.MonkeyPatch()
    patch.setenv("TORCH_EXTENSIONS_DIR", str(path))
    patch.delenv("CXX", raising=False)
    yield path
    patch.undo()


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread: on a busy 2-core CI host two OpenMP threads spin against each other and
    torch's reference optimizers run 4x slower. Thread-count independence has its own test."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
