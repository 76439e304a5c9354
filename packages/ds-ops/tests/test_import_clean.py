"""Importing ds_ops has no side effects: no CUDA init, no optional or undeclared siblings loaded."""

from __future__ import annotations

from ds_comm.testing import import_side_effects

ALLOWED = {"ds_ops", "ds_comm"}


def test_import_loads_only_declared_siblings_and_not_cuda() -> None:
    report = import_side_effects("ds_ops")
    assert not report["cuda_initialized"]
    assert set(report["ds_modules"]) <= ALLOWED, report["ds_modules"]
    # pydantic costs ~0.3 s to import; AioConfig loads it on first use. (ds_comm.testing reports this
    # from ds-comm 0.1 with lazy config models on; older trees import pydantic in ds_comm itself.)
    if "pydantic_loaded" in report:
        assert not report["pydantic_loaded"], "importing ds_ops pulled in pydantic"
