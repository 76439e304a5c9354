"""DeepSpeed's model-specific AutoTP layers: Yuan's shared-QK projections and the fused-qkv layer.

`Yuan_LinearLayer` / `Yuan_LinearAllreduce` (Yuan 2): the value projection and the attention output are cut
by value heads, but under shared-QK attention a rank's value heads are two runs, one in each half of the
heads (the head paired with each of its query heads, and its second-half partner): a two-section cut of
the output features (column) or input features (row), each half split evenly. DeepSpeed's universal
checkpoint cannot describe that selection, so these parameters are recorded as unsupported and
`gather_params` refuses, as DeepSpeed's do; ds's own whole-weight paths (`full_tensor`) still work.

`fused_LinearLayer(module, mp_group, skip_partition, fused_module=...)`: DeepSpeed's fused qkv layer, whose
layout follows the block holding it (`fused_module`): ds's `FusedQKVLinearLayer` with the layout AutoTP
picks for that block. Blocks whose fused layout ds cannot cut (CodeGen's interleaved blocks, GPTBigCode's
replicated key/value, Qwen) are recorded as unsupported and only accepted on a group of one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from ds_parallel.tensor._layers import FusedQKVLinearLayer, LinearAllreduce, LinearLayer
from ds_parallel.tensor._layout import ShardLayout
from ds_parallel.tensor._replace import _SECTIONED_QKV_BLOCKS
from ds_parallel.tensor._replace import _UNSUPPORTED_QKV_BLOCKS as _UNCUT_QKV_BLOCKS

__all__ = ["Yuan_LinearAllreduce", "Yuan_LinearLayer", "fused_LinearLayer"]

_YUAN_REASON = (
    "Yuan shared-QK tensor parallelism selects noncontiguous head groups that universal checkpoint "
    "conversion cannot currently describe"
)
_FUSED_REASON = (
    "its fused qkv layout interleaves or replicates blocks across tensor parallel ranks, so the original "
    "parameter cannot be reassembled from the shards"
)


def _yuan_sections(layer: Any, total: int) -> tuple[tuple[int, ...], ...]:
    """Both halves of the heads, each split evenly: a rank's value heads under shared-QK attention."""
    world = layer.tp_world_size
    if world == 1:
        return ((total,),)
    heads = layer.tp_meta.num_kv_heads
    if not heads or total % heads or heads % world or (heads // world) % 2:
        raise ValueError(
            f"AutoTP: Yuan layer {layer.name!r}: shared-QK needs an even number of heads per rank "
            f"({heads} heads over {world} ranks, {total} features)"
        )
    half = total // 2
    return ((half // world,) * world,) * 2


class Yuan_LinearLayer(LinearLayer):  # noqa: N801 - DeepSpeed's name
    """Yuan's value projection, column-parallel over shared-QK value heads."""

    _unsupported_uc_reason = _YUAN_REASON

    def _layout(self, pname: str, shape: tuple[int, ...]) -> ShardLayout:
        return ShardLayout(0, _yuan_sections(self, shape[0]))

    @torch.no_grad()
    def gather_params(self, params_list: list[torch.Tensor | None]) -> None:
        raise RuntimeError(self._unsupported_uc_reason)


class Yuan_LinearAllreduce(LinearAllreduce):  # noqa: N801 - DeepSpeed's name
    """Yuan's attention output, row-parallel over shared-QK value heads; the bias is replicated."""

    _unsupported_uc_reason = _YUAN_REASON

    def _layout(self, pname: str, shape: tuple[int, ...]) -> ShardLayout:
        if pname == "bias":
            return ShardLayout(None)
        return ShardLayout(1, _yuan_sections(self, shape[1]))

    @torch.no_grad()
    def gather_params(self, params_list: list[torch.Tensor | None]) -> None:
        raise RuntimeError(self._unsupported_uc_reason)


class fused_LinearLayer(FusedQKVLinearLayer):  # noqa: N801 - DeepSpeed's name
    """A fused qkv projection laid out as its block (`fused_module`) lays it out.

    `skip_partition=True` (DeepSpeed: the caller cuts the weight later) is only accepted on a group of
    one, where nothing is cut.
    """

    def __init__(
        self,
        module: nn.Linear,
        mp_group: ProcessGroup | None,
        skip_partition: bool = False,
        *,
        fused_module: nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        if fused_module is None:
            raise ValueError("fused_LinearLayer: 'fused_module' (the block holding the projection) is required")
        block = type(fused_module).__name__
        world = torch.distributed.get_world_size(mp_group) if mp_group is not None else 1
        if block in _UNCUT_QKV_BLOCKS:
            self._unsupported_uc_reason = f"{block}: {_FUSED_REASON}"
        if world > 1 and (skip_partition or block in _UNCUT_QKV_BLOCKS):
            why = "skip_partition" if skip_partition else f"the fused qkv layout of {block}"
            raise ValueError(f"fused_LinearLayer: {why} is not supported by ds on {world} tensor-parallel ranks")
        kwargs.setdefault("interleaved", block not in _SECTIONED_QKV_BLOCKS)
        super().__init__(module, mp_group, **kwargs)
