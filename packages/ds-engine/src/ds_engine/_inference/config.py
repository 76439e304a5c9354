"""`DeepSpeedInferenceConfig`: the settings of `init_inference`, with DeepSpeed 0.19.8's keys and aliases.

Implemented: `dtype`, `tensor_parallel` (`tp`: `tp_size`, `tp_grain_size`, `mpu`, `tp_group`),
`injection_policy` (`injection_dict`), `checkpoint` / `base_dir`, `keep_module_on_host`, `max_out_tokens`,
and the deprecated `mp_size` / `mpu` (mapped into `tensor_parallel`). DeepSpeed's kernel injection,
CUDA graphs, MoE inference and checkpoint re-saving are not implemented: their keys are accepted at their
off/default values only, and anything else is an error that says so. The keys only DeepSpeed's injected
kernels read (Triton, masking, output form, ...), and those DeepSpeed's inference engine does not read at all
(`zero`, `checkpoint_config`, `quant` short of an int8 dtype, `tensor_parallel.enabled`), have nothing to act
on here: any value is accepted and `init_inference` warns once per key set to something else than its
default (`ignored_keys`).
"""

from __future__ import annotations

import warnings
from typing import Any, ClassVar

import torch
from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ds_comm import ConfigDeprecationWarning, ConfigModel

__all__ = ["DeepSpeedInferenceConfig", "DeepSpeedTPConfig", "DtypeEnum"]

_NOT_IMPLEMENTED = "is not implemented in ds"
_KERNELS = "ds does not implement those kernels"


class DtypeEnum:
    """The dtype spellings DeepSpeed accepts, by torch dtype."""

    names: ClassVar[dict[torch.dtype, tuple[str, ...]]] = {
        torch.float16: ("torch.float16", "fp16", "float16", "half"),
        torch.float32: ("torch.float32", "fp32", "float32", "float"),
        torch.bfloat16: ("torch.bfloat16", "bf16", "bfloat16", "bfloat"),
        torch.int8: ("torch.int8", "int8"),
    }

    @classmethod
    def from_str(cls, value: str) -> torch.dtype:
        for dtype, names in cls.names.items():
            if value in names:
                return dtype
        valid = ", ".join(n for names in cls.names.values() for n in names)
        raise ValueError(f"{value!r} is not a dtype name; valid: {valid}")


class DeepSpeedTPConfig(ConfigModel):
    """Tensor parallelism at inference (`tensor_parallel` / `tp`)."""

    ignored_keys: ClassVar[dict[str, str]] = {
        "enabled": "DeepSpeed does not read it either: tensor_parallel.tp_size decides",
    }

    enabled: bool = True
    """Turn tensor parallelism on/off (DeepSpeed ignores it too: tp_size decides)."""
    tp_size: int = Field(1, ge=1)
    """Ranks the model is split across."""
    tp_grain_size: int = Field(64, ge=1)
    """MLP and output-head shards are multiples of this (DeepSpeed's inference default, 64)."""
    mpu: Any = None
    """A model-parallel unit; its model-parallel group is the tensor-parallel group."""
    tp_group: Any = None
    """An existing process group to split over (instead of creating one)."""


class DeepSpeedInferenceConfig(ConfigModel):
    """Every key of DeepSpeed's inference config; unknown keys are errors with a suggestion."""

    inert_keys: ClassVar[dict[str, str]] = {
        "enable_cuda_graph": f"CUDA graph capture {_NOT_IMPLEMENTED}",
        "moe": f"mixture-of-experts inference {_NOT_IMPLEMENTED}",
        "save_mp_checkpoint_path": f"re-saving a tensor-parallel checkpoint {_NOT_IMPLEMENTED}",
        "injection_policy_tuple": "set injection_policy instead",
        "ep_size": f"expert parallelism at inference {_NOT_IMPLEMENTED}",
        "ep_group": f"expert parallelism at inference {_NOT_IMPLEMENTED}",
        "ep_mp_group": f"expert parallelism at inference {_NOT_IMPLEMENTED}",
        "moe_experts": f"mixture-of-experts inference {_NOT_IMPLEMENTED}",
        "moe_type": f"mixture-of-experts inference {_NOT_IMPLEMENTED}",
    }
    ignored_keys: ClassVar[dict[str, str]] = {
        **{
            key: f"only DeepSpeed's injected inference kernels read it (replace_with_kernel_inject), and {_KERNELS}"
            for key in (
                "use_triton",
                "triton_autotune",
                "triangular_masking",
                "return_tuple",
                "min_out_tokens",
                "set_empty_params",
                "training_mp_size",
                "transposed_mode",
            )
        },
        "quant": f"DeepSpeed reads it only for dtype int8 (quantized kernels), and {_KERNELS}",
        "zero": "DeepSpeed's inference engine does not read it either",
        "checkpoint_config": "DeepSpeed's inference engine does not read it either",
    }

    replace_with_kernel_inject: bool = Field(False, alias="kernel_inject")
    """DeepSpeed's fused inference kernels; ds refuses True (AutoTP shards the model's own layers instead)."""
    dtype: torch.dtype = torch.float16
    """The model is converted to this dtype (DeepSpeed's default: fp16)."""
    tensor_parallel: DeepSpeedTPConfig = Field(DeepSpeedTPConfig(), alias="tp")
    """Tensor parallelism (AutoTP)."""
    enable_cuda_graph: bool = False
    use_triton: bool = False
    triton_autotune: bool = False
    zero: dict[str, Any] = {}
    triangular_masking: bool = Field(True, alias="tm")
    """Kernel-injection masking; no effect without kernel injection."""
    moe: bool | dict[str, Any] = {}
    keep_module_on_host: bool = False
    """Leave the model where it is instead of moving it to this rank's device."""
    quant: dict[str, Any] = {}
    checkpoint: str | dict[str, Any] | None = None
    """Whole-model weights to load after sharding: a dict or a JSON file `{"type": "ds_model",
    "checkpoints": [files...], "version": 1.0}`; each file a torch state dict (or `{"module": sd}`)."""
    base_dir: str = ""
    """Directory the checkpoint files are relative to."""
    set_empty_params: bool = False
    save_mp_checkpoint_path: str | None = None
    checkpoint_config: dict[str, Any] = Field({}, alias="ckpt_config")
    return_tuple: bool = True
    """Kernel-injection output form; no effect without kernel injection."""
    training_mp_size: int = 1
    replace_method: str = "auto"
    """Deprecated in DeepSpeed, no effect."""
    injection_policy: dict[Any, Any] | None = Field(None, alias="injection_dict")
    """`{BlockClass: ("self_attn.o_proj", "mlp.down_proj")}`: the blocks to shard and their row-parallel layers."""
    injection_policy_tuple: tuple[Any, ...] | None = None
    config: dict[str, Any] | None = Field(None, alias="args")
    """The model's config, for policies (kept for compatibility)."""
    max_out_tokens: int = Field(1024, alias="max_tokens", gt=0)
    """`generate` refuses prompts longer than this."""
    min_out_tokens: int = Field(1, alias="min_tokens")
    transposed_mode: bool = False
    ep_size: int = 1
    ep_group: Any = Field(None, alias="expert_group")
    ep_mp_group: Any = Field(None, alias="expert_mp_group")
    moe_experts: list[int] = [1]
    moe_type: str = "standard"

    @model_validator(mode="before")
    @classmethod
    def _deprecated_tp_keys(cls, data: Any) -> Any:
        """`mp_size` and `mpu` moved into `tensor_parallel` (as in DeepSpeed, they still work, with a warning)."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for old, new in (("mp_size", "tp_size"), ("mpu", "mpu")):
            if old not in data:
                continue
            value = data.pop(old)
            warnings.warn(
                f"inference config key {old!r} is deprecated; use tensor_parallel.{new} (mapped for you)",
                ConfigDeprecationWarning,
                stacklevel=2,
            )
            key = "tp" if "tp" in data else "tensor_parallel"
            section = data.get(key, {})
            section = section.model_dump() if isinstance(section, DeepSpeedTPConfig) else dict(section)
            if new in section and section[new] != value and not (new == "tp_size" and value == 1):
                raise PydanticCustomError(
                    "duplicate_key",
                    "both {old} (deprecated) and tensor_parallel.{new} are set, to different values",
                    {"old": repr(old), "new": new},
                )
            if not (new == "tp_size" and value == 1 and new in section):
                section[new] = value
            data[key] = section
        return data

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = DtypeEnum.from_str(value)
        if not isinstance(value, torch.dtype):
            raise TypeError(f"expected a torch.dtype or a dtype name, got {type(value).__name__}")
        if value not in (torch.float16, torch.float32, torch.bfloat16):
            raise ValueError(f"{value} is not supported by ds (int8 needs inference quantization, not implemented)")
        return value

    @field_validator("replace_with_kernel_inject")
    @classmethod
    def _no_kernels(cls, value: bool) -> bool:
        if value:
            raise ValueError(
                "replace_with_kernel_inject=True: DeepSpeed's fused inference kernels are not implemented in ds; "
                'use replace_with_kernel_inject=False with tensor_parallel={"tp_size": N} (automatic tensor '
                "parallelism over the model's own layers)"
            )
        return value

    @field_validator("replace_method")
    @classmethod
    def _replace_method(cls, value: str) -> str:
        if value != "auto":
            warnings.warn(
                "replace_method is deprecated and has no effect; remove it", ConfigDeprecationWarning, stacklevel=2
            )
        return value
