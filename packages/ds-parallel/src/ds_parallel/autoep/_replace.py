"""Put a source MoE block's `AutoEPMoELayer` in the block's place (the parts come from `_parts`)."""

from __future__ import annotations

from torch import nn
from torch.distributed import ProcessGroup

from ds_parallel.autoep._layer import AutoEPMoELayer, MoELayerSpec
from ds_parallel.autoep._parts import layer_parts, repack_expert_weights

__all__ = ["replace_moe_block", "repack_expert_weights"]


def replace_moe_block(
    model: nn.Module, spec: MoELayerSpec, *, ep_size: int, ep_rank: int, ep_group: ProcessGroup | None
) -> AutoEPMoELayer:
    """Build the `AutoEPMoELayer` of the block at `spec.moe_module_name` and put it in the block's place.

    Issues no collective; with `ep_size` > 1 and no `ep_group` the layer binds its group later
    (`set_deepspeed_parallelism`).
    """
    parent_name, _, child = spec.moe_module_name.rpartition(".")
    parent = model.get_submodule(parent_name)
    parts = layer_parts(getattr(parent, child), spec, ep_size=ep_size, ep_rank=ep_rank)
    layer = AutoEPMoELayer(spec, **parts, ep_size=ep_size, ep_rank=ep_rank, ep_group=ep_group)
    setattr(parent, child, layer)
    return layer
