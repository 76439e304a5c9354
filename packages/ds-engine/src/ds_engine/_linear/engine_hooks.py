"""What the engine does about `OptimizedLinear` layers it finds in a model, decided once at `initialize()`.

- Their base weights (marked `ds_optim_param`) are each rank's own slice: the initial broadcast from
  data-parallel rank 0 must leave them alone (`replicated`), or every rank would hold rank 0's slice.
- `lora_config.offload_ratio` (one value for the whole model) moves that fraction of the base-weight
  elements, whole parameters in model order, to the host (`apply_offload`); the forward brings each
  back for its computation.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable

import torch
from torch import nn

from ds_engine._linear.optimized_linear import LoRAOptimizedLinear

logger = logging.getLogger(__name__)

__all__ = ["OptimizedLinearLayout", "apply_offload", "is_rank_local", "replicated"]


def is_rank_local(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is an `OptimizedLinear` base weight (each rank's own slice: never broadcast)."""
    return hasattr(tensor, "ds_optim_param")


def replicated(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """`tensors` without the rank-local base weights: what the initial broadcast may make equal."""
    return [t for t in tensors if not is_rank_local(t)]


@dataclasses.dataclass(frozen=True)
class OptimizedLinearLayout:
    """The model's LoRA layers as the engine sees them (DeepSpeed's engine attributes read these)."""

    lora_enabled: bool = False
    """Some layer is a `LoRAOptimizedLinear` (`engine.optimized_linear_lora_enabled`)."""
    base_weight_sharding: bool = False
    """Some layer shards its base weight (`engine.optimized_linear_base_weight_sharding`)."""
    offload_ratio: float | None = None
    offloaded_numel: int = 0
    """Base-weight elements moved to the host."""


def apply_offload(module: nn.Module) -> OptimizedLinearLayout:
    """Find `module`'s LoRA layers and move `offload_ratio` of their base-weight elements to the host.

    Raises:
        ValueError: the layers' `lora_config.offload_ratio` values differ.
    """
    ratio: float | None = None
    sharded = False
    found = False
    for name, layer in module.named_modules():
        if not isinstance(layer, LoRAOptimizedLinear):
            continue
        found = True
        sharded = sharded or layer.zero_shards > 1
        if ratio is not None and layer.lora_config.offload_ratio != ratio:
            raise ValueError(
                f"lora_config.offload_ratio: every OptimizedLinear must use the same value; {name!r} has "
                f"{layer.lora_config.offload_ratio}, an earlier layer {ratio}"
            )
        ratio = layer.lora_config.offload_ratio
    if not found:
        return OptimizedLinearLayout()
    eligible = [p for p in module.parameters() if is_rank_local(p)]
    limit = sum(p.numel() for p in eligible) * (ratio or 0.0)
    moved = 0
    for p in eligible:
        p.ds_offload = moved < limit  # type: ignore[attr-defined]
        if p.ds_offload:  # type: ignore[attr-defined]
            moved += p.numel()
            p.data = p.data.to("cpu")
    layout = OptimizedLinearLayout(True, sharded, ratio, moved)
    logger.info(
        "OptimizedLinear: LoRA layers found; base weights %s, left out of the initial broadcast; %d of %d "
        "base-weight elements kept on the host (lora_config.offload_ratio=%s)",
        "sharded over the ranks" if sharded else "whole on each rank",
        moved,
        sum(p.numel() for p in eligible),
        ratio,
    )
    return layout
