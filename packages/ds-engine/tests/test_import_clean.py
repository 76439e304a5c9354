"""Importing ds_engine has no side effects: no CUDA init, no optional or undeclared siblings loaded."""

from __future__ import annotations

from ds_comm.testing import import_side_effects

ALLOWED = {"ds_engine", "ds_comm", "ds_ops"}


def test_import_loads_only_declared_siblings_and_not_cuda() -> None:
    report = import_side_effects("ds_engine")
    assert not report["cuda_initialized"]
    assert set(report["ds_modules"]) <= ALLOWED, report["ds_modules"]
    # pydantic alone costs ~0.3 s to import (the whole import-time budget); config models load on first use.
    assert not report["pydantic_loaded"], "importing the package pulled in pydantic"
