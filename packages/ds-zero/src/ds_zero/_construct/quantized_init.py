"""ZeRO-Inference quantized initialization: `weight_quantization.quantized_initialization`.

With that section, `ds_zero.Init` quantizes the `weight` of every `nn.Linear` / `nn.Embedding` built
inside it (exact types, as DeepSpeed: `WEIGHT_QUANTIZATION_LAYERS`) before partitioning it, so each rank
holds 1/N of a weight 2 (8 bits) or 4+ (4 bits) times smaller than fp16. The quantized weight is one
tensor in the parameter's dtype: the codes' bytes (padded to whole elements), then each group's step,
then each group's minimum (`ds_zero._quantizer.GroupQuantizer`). The parameter keeps `requires_grad`
and gets DeepSpeed's attributes: `weight_quantized = True`, and `quantizer`, `dequantizer` and
`deconcat` (here one `QuantizedLayout` and its method), which is how a gathered weight (it comes back
quantized from `GatheredParameters` and the stage-3 forward) is turned back into values.

Entering such an `Init` (with `mem_efficient_linear`, which installs `zero3_linear_wrap` first) wraps
`torch.nn.functional.linear` and `embedding` with `functools.wraps` wrappers that dequantize a quantized
weight before calling the function they wrap (so `F.linear.__wrapped__ is zero3_linear_wrap`), and
wraps `nn.Linear` / `nn.Embedding`'s `_load_from_state_dict` so a full-precision state-dict weight is
quantized on load. Like DeepSpeed's, the wrappers stay for the rest of the process; unlike DeepSpeed's,
they are installed once, not once more per entered `Init`.

It is inference-only: the dequantized values are computed from integer codes, so no gradient reaches a
quantized weight (as in DeepSpeed); the stage-3 optimizer refuses to train one (`refuse_trainable`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.nn import functional

from ds_zero._quantizer import GroupQuantizer

__all__ = [
    "WEIGHT_QUANTIZATION_LAYERS",
    "QuantizedLayout",
    "install_quantized_wrappers",
    "quantize_module_weights",
    "quantize_param",
    "refuse_trainable",
    "wrap_load_from_state_dict",
    "wrap_quantized_functional",
]

#: The module types whose `weight` is quantized (exact types, not subclasses, as DeepSpeed).
WEIGHT_QUANTIZATION_LAYERS: tuple[type[nn.Module], ...] = (nn.Linear, nn.Embedding)

_WRAPPED = "_ds_dequantizing_wrapper"


@dataclasses.dataclass(frozen=True)
class QuantizedLayout:
    """Where the codes, steps and minimums of one quantized weight sit in its single storage tensor.

    Args:
        quantizer: the group quantizer.
        shape: the full-precision weight's shape.
        dtype: the parameter's dtype (of the storage tensor and of the dequantized values).
    """

    quantizer: GroupQuantizer
    shape: torch.Size
    dtype: torch.dtype

    @functools.cached_property
    def _sizes(self) -> tuple[int, int, int]:
        """(code bytes, storage elements holding them, groups)."""
        grouped = self.quantizer._grouped_shape(self.shape)
        groups = grouped[self.quantizer.group_dim] * int(torch.Size(grouped[: self.quantizer.group_dim]).numel())
        groups *= int(torch.Size(grouped[self.quantizer.group_dim + 2 :]).numel())
        code_bytes = self.shape.numel() // (2 if self.quantizer.num_bits == 4 else 1)
        item = self.dtype.itemsize
        return code_bytes, -(-code_bytes // item), groups

    @property
    def numel(self) -> int:
        """Elements of the storage tensor."""
        _, code_elems, groups = self._sizes
        return code_elems + 2 * groups

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """The storage tensor (1-D, `dtype`) of `tensor` quantized.

        Raises:
            ValueError: `tensor`'s shape is not this layout's.
        """
        if tensor.shape != self.shape:
            raise ValueError(f"a quantized weight of shape {tuple(self.shape)} cannot take a {tuple(tensor.shape)}")
        codes, step, low = self.quantizer.quantize(tensor, dtype=self.dtype)
        code_bytes, code_elems, _ = self._sizes
        padded = torch.zeros(code_elems * self.dtype.itemsize, dtype=torch.uint8, device=codes.device)
        padded[:code_bytes] = codes.reshape(-1)
        return torch.cat([padded.view(self.dtype), step.reshape(-1), low.reshape(-1)])

    def deconcat(self, stored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(codes, step, min)` views of a storage tensor; the codes as `dtype` elements (DeepSpeed's order)."""
        _, code_elems, groups = self._sizes
        flat = stored.reshape(-1)
        return flat[:code_elems], flat[code_elems : code_elems + groups], flat[code_elems + groups :]

    def dequantize(self, codes: torch.Tensor, step: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
        """The weight's values (shape `shape`, `dtype`) from `deconcat`'s parts (codes as `dtype` or as bytes)."""
        code_bytes, _, _ = self._sizes
        raw = codes.detach().reshape(-1).view(torch.uint8)[:code_bytes]
        code_shape = (*self.shape[:-1], self.shape[-1] // 2) if self.quantizer.num_bits == 4 else tuple(self.shape)
        grouped = self.quantizer._grouped_shape(self.shape)
        stat_shape = (*grouped[: self.quantizer.group_dim + 1], 1, *grouped[self.quantizer.group_dim + 2 :])
        return self.quantizer.dequantize(
            raw.reshape(code_shape), step.detach().reshape(stat_shape), minimum.detach().reshape(stat_shape), self.dtype
        )

    def values(self, stored: torch.Tensor) -> torch.Tensor:
        """The weight's values from a (gathered) storage tensor."""
        return self.dequantize(*self.deconcat(stored))

    # DeepSpeed's `param.quantizer.quantize(tensor)` name
    def quantize(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`deconcat(pack(tensor))`."""
        return self.deconcat(self.pack(tensor))


def quantize_param(param: nn.Parameter, quantizer: GroupQuantizer) -> None:
    """Replace `param`'s values by their quantized storage tensor and mark it (DeepSpeed's `_quantize_param`).

    Raises:
        ValueError: `param` is quantized already, or its shape does not split into `quantizer`'s groups.
    """
    if getattr(param, "weight_quantized", False):
        raise ValueError(f"parameter of shape {tuple(param.shape)} is quantized already")
    layout = QuantizedLayout(quantizer, param.shape, param.dtype)
    param.data = layout.pack(param.data)
    param.quantizer = layout  # type: ignore[attr-defined]
    param.dequantizer = layout  # type: ignore[attr-defined]
    param.deconcat = layout.deconcat  # type: ignore[attr-defined]
    param.weight_quantized = True  # type: ignore[attr-defined]


def quantize_module_weights(
    module: nn.Module, quantizer: GroupQuantizer, *, skip: Callable[[nn.Parameter], bool], dtype: torch.dtype | None
) -> int:
    """Quantize the `weight` of `module` and every submodule of a `WEIGHT_QUANTIZATION_LAYERS` type; returns how many.

    Weights for which `skip(param)` is true (already partitioned) are left alone; `dtype` (Init's) is
    applied to a floating-point weight first, since the storage tensor's bytes must not be cast later.

    Raises:
        ValueError: a weight does not split into the quantizer's groups (the message names the key and layer).
    """
    count = 0
    for sub in module.modules():
        weight = sub._parameters.get("weight") if type(sub) in WEIGHT_QUANTIZATION_LAYERS else None
        if weight is None or skip(weight) or getattr(weight, "weight_quantized", False):
            continue
        if dtype is not None and weight.is_floating_point() and weight.dtype != dtype:
            weight.data = weight.data.to(dtype)
        try:
            quantize_param(weight, quantizer)
        except ValueError as err:
            key = "weight_quantization.quantized_initialization"
            raise ValueError(f"{key}: {type(sub).__name__}.weight: {err}") from None
        count += 1
    return count


def wrap_quantized_functional(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`fn(input, weight, ...)` that first dequantizes a quantized `weight` (DeepSpeed's wrapper)."""

    @functools.wraps(fn)
    def wrapper(input: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:  # noqa: A002 - torch's names
        if getattr(weight, "weight_quantized", False):
            weight = weight.dequantizer.values(weight)  # type: ignore[union-attr]
        return fn(input, weight, *args, **kwargs)

    setattr(wrapper, _WRAPPED, True)
    return wrapper


def wrap_load_from_state_dict(load: Callable[..., None]) -> Callable[..., None]:
    """`Module._load_from_state_dict` that quantizes the state dict's full-precision `weight` for a quantized one."""

    @functools.wraps(load)
    def wrapper(
        module: nn.Module,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        weight = module._parameters.get("weight")
        key = prefix + "weight"
        loaded = state_dict.get(key)
        swapped = (
            weight is not None
            and getattr(weight, "weight_quantized", False)
            and isinstance(loaded, torch.Tensor)
            and loaded.shape == weight.quantizer.shape  # type: ignore[union-attr]
        )
        if swapped:
            state_dict[key] = weight.quantizer.pack(loaded.to(weight.device))  # type: ignore[union-attr]
        try:
            load(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        finally:
            if swapped:
                state_dict[key] = loaded

    setattr(wrapper, _WRAPPED, True)
    return wrapper


def install_quantized_wrappers() -> None:
    """Wrap `F.linear`, `F.embedding` and the quantized layers' state-dict loading (once per process)."""
    for name in ("linear", "embedding"):
        current = getattr(functional, name)
        if not getattr(current, _WRAPPED, False):
            setattr(functional, name, wrap_quantized_functional(current))
    for cls in WEIGHT_QUANTIZATION_LAYERS:
        current = cls._load_from_state_dict
        if not getattr(current, _WRAPPED, False):
            cls._load_from_state_dict = wrap_load_from_state_dict(current)  # type: ignore[method-assign]


def refuse_trainable(params: Iterable[nn.Parameter]) -> None:
    """Refuse to optimize a quantized weight that requires grad.

    Raises:
        ValueError: one of `params` is quantized and requires grad (it gets no gradient; an optimizer with
            weight decay or momentum would overwrite its codes with garbage).
    """
    for p in params:
        if getattr(p, "weight_quantized", False) and p.requires_grad:
            raise ValueError(
                "weight_quantization.quantized_initialization: a quantized weight cannot be trained (it is "
                "inference-only and gets no gradient); freeze it (param.requires_grad_(False)) before building "
                "the optimizer, or run the engine without an optimizer"
            )
