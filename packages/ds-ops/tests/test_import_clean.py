"""Importing ds_ops has no side effects: no CUDA init, no optional or undeclared siblings loaded."""

from __future__ import annotations

from ds_comm.testing import import_side_effects

ALLOWED = {"ds_ops", "ds_comm"}


def test_import_loads_only_declared_siblings_and_not_cuda() -> None:
    report = import_side_effects("ds_ops")
    assert not report["cuda_initialized"]
    assert set(report["ds_modules"]) <= ALLOWED, report["ds_modules"]
    # pydantic alone costs ~0.3 s to import (the whole import-time budget); AioConfig loads it on first use.
    assert not report["pydantic_loaded"], "importing ds_ops pulled in pydantic"
