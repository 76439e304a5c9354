"""`deepspeed.ops` for migrated scripts: the optimizers of ds-ops under DeepSpeed's module paths.

`from ds_engine.ops.adam import DeepSpeedCPUAdam, FusedAdam`, `ds_engine.ops.adagrad.DeepSpeedCPUAdagrad`,
`ds_engine.ops.lion.DeepSpeedCPULion`, `ds_engine.ops.aio.AsyncIOBuilder`, `ds_engine.ops.random_ltd`
(random-LTD's token gather/scatter, plain PyTorch). Importing them builds nothing: ops compile on first use.
`ds_engine.ops.op_builder` holds the builders and `ds_engine.ops.__compatible_ops__` says which ops can
build here (probed on first access).
"""

from __future__ import annotations

import importlib
from typing import Any

from ds_engine.ops import adagrad, adam, lion

__all__ = ["adagrad", "adam", "lion"]


def __getattr__(name: str) -> Any:
    # `__compatible_ops__` runs each op's compiler probe: on first access, never at import.
    if name == "__compatible_ops__":
        return importlib.import_module("ds_engine.git_version_info").compatible_ops
    if name in ("aio", "op_builder", "random_ltd"):
        return importlib.import_module(f"ds_engine.ops.{name}")
    raise AttributeError(f"module 'ds_engine.ops' has no attribute {name!r}")
