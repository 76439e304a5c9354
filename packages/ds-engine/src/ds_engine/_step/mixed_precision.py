"""What fp16/bf16 training casts at initialize(): parameters to the training dtype, buffers only on request.

[Note: buffers keep their dtype] Casting the whole module (`module.bfloat16()`) also casts buffers, and
some buffers must stay fp32 to be right: a rotary embedding's `inv_freq` in bf16 loses enough bits to
shift every position's angle. So, as FSDP's `MixedPrecisionPolicy` does and DeepSpeed 0.19.8 does, the
parameters follow the fp16/bf16 switch and buffers keep the dtype they were loaded in unless
`data_types.buffer_dtype` names one.

[Note: buffers kept in fp32] Some buffers must be fp32 whatever they were loaded in: a mixture-of-experts
routing bias (`e_score_correction_bias`) whose values differ by less than bf16's spacing would send tokens
to other experts. Hugging Face models name them (`_keep_in_fp32_modules_strict`, and under fp16 also
`_keep_in_fp32_modules`); `data_types.keep_in_fp32_modules` ("auto": those lists; or name patterns; `[]`:
none) selects the buffers that, under fp16/bf16 training, are brought to fp32 and left out of a
`buffer_dtype` cast, as DeepSpeed 0.19.8 does. Parameters always follow the training dtype.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from torch import nn

from ds_engine.config._dtype_names import DTYPES, to_torch_dtype

__all__ = ["cast_module_mixed_precision", "keep_in_fp32_pattern", "mixed_precision_dtypes"]

_HALF = (torch.float16, torch.bfloat16)


def _glob(name: str) -> str:
    # transformers' matching: `*` is any run of characters, the rest is taken as a regular expression
    return name.replace("*", ".*")


def keep_in_fp32_pattern(
    module: nn.Module, setting: str | Sequence[str], param_dtype: torch.dtype | None
) -> re.Pattern[str] | None:
    """The buffer names `data_types.keep_in_fp32_modules` keeps in fp32 (matched with `search`), or None.

    Args:
        module: the model.
        setting: "auto" (each submodule's Hugging Face lists, for that submodule's buffers) or name patterns
            (`*` any characters; found anywhere in a buffer's full name); `[]` keeps none.
        param_dtype: the training dtype; nothing is kept unless it is fp16 or bf16.
    """
    if param_dtype not in _HALF:
        return None
    if isinstance(setting, str):
        alternatives: set[str] = set()
        for prefix, sub in module.named_modules():
            names = list(getattr(sub, "_keep_in_fp32_modules_strict", None) or [])
            if param_dtype == torch.float16:
                names += list(getattr(sub, "_keep_in_fp32_modules", None) or [])
            for name in names:
                alternatives.add(rf"^{re.escape(prefix)}\..*{_glob(name)}" if prefix else _glob(name))
    else:
        alternatives = {_glob(name) for name in setting}
    return re.compile("|".join(sorted(alternatives))) if alternatives else None


_PRECISION_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def mixed_precision_dtypes(precision: str, buffer_dtype: str | None) -> tuple[torch.dtype | None, torch.dtype | None]:
    """(parameter dtype, buffer dtype) that initialize() casts to.

    Args:
        precision: "fp16", "bf16" or "fp32" (the fp16/bf16 switches).
        buffer_dtype: `data_types.buffer_dtype` ("bf16", "fp16", "fp32", or a torch-style alias), or None.

    Returns:
        The parameter dtype (None under fp32: parameters stay as they are) and the buffer dtype (None:
        buffers keep theirs).

    Raises:
        ValueError: `buffer_dtype` names no dtype.
    """
    buffers = None
    if buffer_dtype is not None:
        # Here, not at module level: `_types` imports pydantic, which `import ds_engine` must not load.
        from ds_engine.config._types import dtype_name

        name = dtype_name(buffer_dtype)
        if not isinstance(name, str) or name not in DTYPES:
            raise ValueError(f"data_types.buffer_dtype={buffer_dtype!r} is not one of fp32, fp16, bf16")
        buffers = to_torch_dtype(name)
    return _PRECISION_DTYPES.get(precision), buffers


def cast_module_mixed_precision(
    module: nn.Module,
    param_dtype: torch.dtype | None,
    buffer_dtype: torch.dtype | None,
    *,
    skip_params: bool = False,
    keep_fp32: re.Pattern[str] | None = None,
) -> None:
    """Cast `module`'s floating-point parameters to `param_dtype` and its buffers to `buffer_dtype`, in place.

    Args:
        module: the model; cast where it lies (no device move).
        param_dtype: None leaves parameters alone.
        buffer_dtype: None leaves buffers alone (see the module note).
        skip_params: leave parameters alone anyway (DeepSpeed's choice for a model built under
            `zero.Init`, whose parameters already have the dtype the Init context gave them).
        keep_fp32: buffers whose full names it matches are brought to fp32 (from fp16/bf16) and left out of
            the buffer cast (`keep_in_fp32_pattern`).

    [Note: stage-3 parameters] A parameter partitioned by `zero.Init` holds a value-less placeholder;
    ds-zero overrides `_apply` on the modules that own such parameters so that a conversion converts the
    shard instead. Parameters are cast through each module's own `_apply` (not `p.data = p.data.to(...)`)
    to take that path.
    """
    with torch.no_grad():
        if param_dtype is not None and not skip_params:
            _cast_parameters(module, param_dtype)
        kept: set[int] = set()
        if keep_fp32 is not None:
            for name, b in module.named_buffers():
                if keep_fp32.search(name) and b.is_floating_point():
                    kept.add(id(b))
                    if b.dtype in _HALF:
                        b.data = b.data.float()
        if buffer_dtype is not None:
            for b in module.buffers():
                if b.is_floating_point() and b.dtype != buffer_dtype and id(b) not in kept:
                    b.data = b.data.to(buffer_dtype)


def _cast_parameters(module: nn.Module, dtype: torch.dtype) -> None:
    buffers = {id(b) for b in module.buffers()}
    if all(p.dtype == dtype for p in module.parameters() if p.is_floating_point()):
        return

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and id(t) not in buffers else t

    for m in module.modules():
        if m._parameters:
            m._apply(cast, recurse=False)
