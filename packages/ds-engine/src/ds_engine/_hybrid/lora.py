"""LoRA fusion for generation: DeepSpeed-Chat's layer convention, merged into the base weight and restored.

DeepSpeed-Chat's LoRA linear keeps the frozen `weight` ([out, in]) and two trained factors,
`lora_right_weight` ([in, r]) and `lora_left_weight` ([r, out]), and adds
`lora_scaling * x @ right @ left` to the linear's output. For generation that second branch is one more
pair of matmuls per layer per token; the hybrid engine merges it into the weight instead
(`weight += lora_scaling * left.T @ right.T`) and runs those modules as plain linears while generating.

Unfusing subtracts nothing: floating-point `(w + d) - d` is not always `w`, and the weight must come
back bit for bit for training to go on where it was. The original weights are kept aside while fused
and copied back.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LoraLayer", "LoraFusion", "find_lora_layers"]

_LORA_ATTRS = ("lora_right_weight", "lora_left_weight", "lora_scaling")


@dataclasses.dataclass(slots=True)
class LoraLayer:
    """One module with DeepSpeed-Chat's LoRA attributes."""

    name: str
    module: nn.Module

    @property
    def params(self) -> list[nn.Parameter]:
        """The LoRA factors (the ones a ZeRO-3 gather must include besides the base weight)."""
        m: Any = self.module
        return [t for t in (m.lora_right_weight, m.lora_left_weight) if isinstance(t, nn.Parameter)]

    def delta(self) -> torch.Tensor:
        """`lora_scaling * left.T @ right.T`, the base weight's shape and dtype."""
        m: Any = self.module
        weight, right, left = m.weight, m.lora_right_weight, m.lora_left_weight
        out_f, in_f = weight.shape
        if right.shape[0] != in_f or left.shape[1] != out_f or right.shape[1] != left.shape[0]:
            raise ValueError(
                f"LoRA layer {self.name!r}: lora_right_weight {tuple(right.shape)} and lora_left_weight "
                f"{tuple(left.shape)} do not fit weight {tuple(weight.shape)} (DeepSpeed-Chat's convention: "
                f"right is [in_features, r] = [{in_f}, r], left is [r, out_features] = [r, {out_f}])"
            )
        return (m.lora_scaling * torch.matmul(left.t(), right.t())).to(weight.dtype)


def find_lora_layers(model: nn.Module) -> list[LoraLayer]:
    """Every submodule with a `weight` and all of `lora_right_weight`, `lora_left_weight`, `lora_scaling`."""
    found = []
    for name, module in model.named_modules():
        if all(hasattr(module, a) for a in _LORA_ATTRS) and isinstance(getattr(module, "weight", None), torch.Tensor):
            found.append(LoraLayer(name, module))
    return found


def _plain_linear(module: Any) -> Any:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, module.weight, getattr(module, "bias", None))

    return forward


class LoraFusion:
    """Merges and restores the LoRA layers of one model (`fuse()` ... `unfuse()`).

    While fused each layer's `forward` is a plain linear on the merged weight (an instance attribute,
    deleted by `unfuse`), and DeepSpeed-Chat's `fuse_lora` flag, where the module has one, is True.
    The caller makes sure the weights are real (gathered, under ZeRO-3) from `fuse()` to `unfuse()`.
    """

    def __init__(self, layers: list[LoraLayer]) -> None:
        self.layers = layers
        self._saved: list[tuple[LoraLayer, torch.Tensor, Any, Any]] = []

    @property
    def fused(self) -> bool:
        return bool(self._saved)

    def fuse(self) -> None:
        if self._saved:
            raise RuntimeError("LoRA weights are already fused; unfuse_lora_weight() first")
        try:
            with torch.no_grad():
                for layer in self.layers:
                    m: Any = layer.module
                    delta = layer.delta()
                    original = m.weight.detach().clone()
                    self._saved.append(
                        (layer, original, m.__dict__.get("forward", _ABSENT), m.__dict__.get("fuse_lora", _ABSENT))
                    )
                    m.weight.add_(delta)
                    m.forward = _plain_linear(m)
                    if isinstance(getattr(m, "fuse_lora", None), bool):
                        m.fuse_lora = True
        except BaseException:
            self.unfuse()
            raise

    def unfuse(self) -> None:
        with torch.no_grad():
            while self._saved:
                layer, original, forward, flag = self._saved.pop()
                m: Any = layer.module
                m.weight.copy_(original)
                if forward is _ABSENT:
                    m.__dict__.pop("forward", None)
                else:
                    m.forward = forward
                if flag is not _ABSENT:
                    m.fuse_lora = flag


_ABSENT = object()
