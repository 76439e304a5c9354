"""Importing ds_parallel has no side effects: no CUDA init, no siblings but ds-comm, no pydantic."""

from __future__ import annotations

from ds_comm.testing import import_side_effects

ALLOWED = {"ds_parallel", "ds_comm"}


def test_import_loads_only_declared_siblings_and_not_cuda() -> None:
    report = import_side_effects("ds_parallel")
    assert not report["cuda_initialized"]
    assert set(report["ds_modules"]) <= ALLOWED, report["ds_modules"]
    assert not report["pydantic_loaded"], "importing the package pulled in pydantic"
