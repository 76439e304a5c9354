"""The `tensor_parallel` section (DeepSpeed's `TPTrainingConfig`): automatic tensor parallelism in training.

`autotp_size` > 1 makes initialize() build ds-parallel's mesh with a "tp" dim of that size, shard the
model's linear layers with AutoTP, and run data parallelism (and ZeRO) over the remaining ranks.
`partition_config` / `preset_model` choose the cuts by regex layer specs (read by ds-parallel at
initialize()). Vocabulary-parallel heads, overlapped communication and kernel injection are not
implemented: only their off values are accepted.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from pydantic import Field, field_validator

from ds_comm import ConfigModel
from ds_engine.config._types import NonNegInt, PosInt

__all__ = ["TPConfig", "TensorParallelConfig"]

_NOT_IMPLEMENTED = "is not implemented in ds"
_DTYPES = {
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}


class TPConfig(ConfigModel):
    """`tensor_parallel.tp` (alias `tensor_parallel`): the group settings."""

    tp_size: PosInt = 1
    """Must be 1 or equal to `autotp_size`."""
    tp_grain_size: PosInt = 1
    """MLP shards are multiples of this."""
    mpu: Any = None
    """Not used in training (pass mpu= to initialize())."""
    tp_group: Any = None
    """Not used in training (initialize() builds the group from the mesh)."""


class TensorParallelConfig(ConfigModel):
    """`tensor_parallel`: automatic tensor parallelism (AutoTP) for training."""

    inert_keys: ClassVar[dict[str, str]] = {
        "tp_overlap_comm": f"overlapping the tensor-parallel all-reduce with compute {_NOT_IMPLEMENTED}",
        "vocab_parallel_lm_head": f"vocabulary-parallel output heads {_NOT_IMPLEMENTED}",
        "vocab_parallel_ce_backend": f"vocabulary-parallel cross entropy {_NOT_IMPLEMENTED}",
        "injection_policy_tuple": f"injection policies in training {_NOT_IMPLEMENTED}",
        "replace_with_kernel_inject": f"kernel injection {_NOT_IMPLEMENTED}",
    }

    autotp_size: NonNegInt = 0
    """Tensor-parallel degree (0 or 1: off)."""
    dtype: torch.dtype = torch.float16
    """Recorded as DeepSpeed does; the training dtype comes from the fp16/bf16 sections."""
    tp_overlap_comm: bool = False
    vocab_parallel_lm_head: bool | None = None
    vocab_parallel_ce_backend: str = "torch"
    tensor_parallel: TPConfig = Field(TPConfig(), alias="tp")
    """Group settings."""
    injection_policy_tuple: tuple[Any, ...] | None = None
    partition_config: dict[str, Any] | None = None
    """Regex layer specs deciding the cuts (`ds_parallel.tensor.AutoTPConfig.from_dict`; checked at initialize())."""
    preset_model: str | None = None
    """A built-in spec list (llama, bloom, chatglm, mixtral, deepseek_v2, qwen2, phi3)."""
    keep_module_on_host: bool = False
    """Accepted for compatibility; the engine places the model on its device either way."""
    replace_with_kernel_inject: bool = Field(False, alias="kernel_inject")

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype(cls, value: Any) -> Any:
        if isinstance(value, str):
            key = value.removeprefix("torch.")
            if key not in _DTYPES:
                raise ValueError(f"{value!r} is not a dtype name; valid: {', '.join(_DTYPES)}")
            return _DTYPES[key]
        return value

    @property
    def enabled(self) -> bool:
        return self.autotp_size > 1
