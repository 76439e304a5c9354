"""`deepspeed.runtime.tensor_parallel.config`: the `tensor_parallel` section's models under DeepSpeed's names.

`TPTrainingConfig` is ds-engine's `TensorParallelConfig` (the section, with DeepSpeed's keys and
defaults) and `TPConfig` its `tp` sub-section; `get_tensor_parallel_config(ds_config)` reads the section
of a config dict. `AUTOTP_MODE` is ds-parallel's `AutoTPMode` (what `get_autotp_mode()` returns), so it
needs the `parallel` extra and loads on first use; so does `_get_hf_tp_plan(model)`, ds-parallel's
`extract_hf_tp_plan` (a Hugging Face model's merged tensor-parallel plan, which initialize() shards by).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ds_engine._optional import require
from ds_engine.config._tensor_parallel import TensorParallelConfig, TPConfig

if TYPE_CHECKING:
    from ds_parallel.tensor import AutoTPMode as AUTOTP_MODE

__all__ = ["AUTOTP_MODE", "TPConfig", "TPTrainingConfig", "_get_hf_tp_plan", "get_tensor_parallel_config"]

TPTrainingConfig = TensorParallelConfig


def get_tensor_parallel_config(ds_config: Mapping[str, Any]) -> TensorParallelConfig:
    """The `tensor_parallel` section of a config dict (defaults when it has none).

    Raises:
        pydantic.ValidationError / ds_comm.ConfigError: a bad key or value in the section (named).
    """
    section = ds_config.get("tensor_parallel")
    return TensorParallelConfig(**dict(section)) if section else TensorParallelConfig()


def _get_hf_tp_plan(model: Any) -> dict[str, str] | None:
    """The model's Hugging Face tensor-parallel plan, merged from its config, class and instance (None: none).

    Raises:
        ImportError: ds-parallel is missing (names `pip install 'ds-engine[parallel]'`).
    """
    tensor = require("ds_parallel", extra="parallel", feature="_get_hf_tp_plan").tensor
    plan: dict[str, str] | None = tensor.extract_hf_tp_plan(model)
    return plan


def __getattr__(name: str) -> Any:
    if name == "AUTOTP_MODE":
        return require("ds_parallel", extra="parallel", feature="AUTOTP_MODE").tensor.AutoTPMode
    raise AttributeError(f"module 'ds_engine.runtime.tensor_parallel.config' has no attribute {name!r}")
