"""Every module under `ds_engine.runtime` is an attribute of the package without importing it first.

DeepSpeed's own test helpers patch `deepspeed.runtime.engine.DeepSpeedEngine.deepspeed_io` after a bare
`import deepspeed`; that only works if the package resolves its submodules on attribute access.
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import ds_engine.runtime as runtime

_NEEDS = {"pipe": "ds_pipe", "activation_checkpointing": "ds_pipe", "zero": "ds_zero", "zenflow": "ds_zero"}
_NEEDS |= {"sequence_parallel": "ds_parallel", "tensor_parallel": "ds_parallel", "chunked_cross_entropy": "ds_parallel"}


@pytest.mark.parametrize("name", sorted(m.name for m in pkgutil.iter_modules(runtime.__path__)))
def test_submodule_is_an_attribute(name: str) -> None:
    if name in _NEEDS:
        pytest.importorskip(_NEEDS[name])
    assert getattr(runtime, name) is importlib.import_module(f"ds_engine.runtime.{name}")


def test_engine_class_through_the_attribute_path() -> None:
    import ds_engine

    assert runtime.engine.DeepSpeedEngine is ds_engine.DeepSpeedEngine
    with pytest.raises(AttributeError, match="no attribute 'no_such_module'"):
        runtime.no_such_module  # noqa: B018
