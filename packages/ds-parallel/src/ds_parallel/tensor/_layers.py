"""Tensor-parallel replacements for `nn.Linear`: column-parallel, row-parallel, the output head, fused.

Each layer takes the original `nn.Linear` (whole weights), keeps only this rank's shard, and records a
`ShardLayout` per parameter so the whole weight can be gathered back (`full_tensor`, DeepSpeed's
`gather_params`) or a whole weight loaded into the shard (`load_full`). Parameters cut across ranks carry
`tensor_model_parallel = True` (DeepSpeed's marker, read by gradient-norm code); replicated ones do not.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

import ds_comm
from ds_parallel.tensor._layout import ShardLayout
from ds_parallel.tensor._mode import is_autotp_training_mode
from ds_parallel.tensor._regions import (
    all_gather_along,
    copy_to_tp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
)
from ds_parallel.tensor._shard_sizes import TPMeta, shard_sizes
from ds_parallel.tensor._uc_meta import mark_param_from_layout

logger = logging.getLogger(__name__)

__all__ = [
    "FusedQKVLinearLayer",
    "GateUpPackLinearLayer",
    "LinearAllreduce",
    "LinearLayer",
    "LmHeadLinearAllreduce",
    "TensorParallelLayer",
]

#: DeepSpeed's parameter attributes: a parameter cut across the tensor-parallel ranks, and one owned by
#: a replaced layer.
TENSOR_MODEL_PARALLEL = "tensor_model_parallel"
IS_REPLACED_MODULE = "ds_is_replaced_module"


class TensorParallelLayer(nn.Module):
    """A linear layer holding this rank's shard of the original's weight (and bias).

    Args:
        module: the original `nn.Linear` (or a module computing `x @ weight.T + bias`), whole; its
            parameters are replaced by shards, not modified.
        mp_group: the tensor-parallel group (None: a group of one, nothing is cut).
        name: the layer's name inside its block (decides the split rule: by heads or near even).
        tp_meta: the model's head counts and grain.
        training: build for training (trainable shards, differentiable collectives); None: the
            process-wide `set_autotp_mode`.

    """

    weight: nn.Parameter
    bias: nn.Parameter | None
    #: DeepSpeed's name for how the layer cuts ("column": output features, "row": input features).
    _uc_partition_type = "column"
    #: Why a universal checkpoint cannot describe this layer's cut (None: it can).
    _unsupported_uc_reason: str | None = None

    def __init__(
        self,
        module: nn.Linear,
        mp_group: ProcessGroup | None,
        *,
        name: str = "",
        tp_meta: TPMeta | None = None,
        training: bool | None = None,
    ) -> None:
        super().__init__()
        self.mp_group = mp_group
        self.tp_world_size = ds_comm.get_world_size(mp_group) if mp_group is not None else 1
        self.tp_index = ds_comm.get_rank(mp_group) if mp_group is not None else 0
        self.name = name
        self.tp_meta = tp_meta or TPMeta()
        self.training_mode = is_autotp_training_mode() if training is None else training
        # A linear-like module named by a partition_config spec need not be an nn.Linear: its weight says.
        weight_shape = tuple(getattr(module.weight, "ds_shape", None) or module.weight.shape)
        self.in_features = getattr(module, "in_features", weight_shape[-1])
        self.out_features = getattr(module, "out_features", weight_shape[0])
        self.layouts: dict[str, ShardLayout] = {}
        #: A gathered parameter's shard storage, written back by `_tp_partition` (see `gather_params`).
        self._shard_storage: dict[str, torch.Tensor] = {}
        #: Each parameter's whole shape (under ZeRO-3, the `ds_shape` it had before being partitioned).
        self._orig_shapes: dict[str, tuple[int, ...]] = {}
        for pname in ("weight", "bias"):
            full = getattr(module, pname, None)
            if full is None:
                self.register_parameter(pname, None)
                continue
            shape = tuple(getattr(full, "ds_shape", None) or full.shape)
            self._orig_shapes[pname] = shape
            # A share may be empty (a grain larger than the dimension): that rank contributes nothing, as in DeepSpeed.
            layout = self._layout(pname, shape)
            self.layouts[pname] = layout
            shard = self._initial_shard(pname, layout, full.data, shape)
            param = nn.Parameter(shard, requires_grad=self.training_mode and full.requires_grad)
            setattr(param, IS_REPLACED_MODULE, True)
            # DeepSpeed hangs the layer's whole-weight hooks on its parameters: `p.gather_params([p])`, then
            # `p._tp_partition([p])` (scripts and checkpoint code call them on the parameter)
            param.gather_params = self.gather_params  # type: ignore[attr-defined]
            param._tp_partition = self._tp_partition  # type: ignore[attr-defined]
            if not layout.replicated and self.tp_world_size > 1:
                setattr(param, TENSOR_MODEL_PARALLEL, True)
            self.register_parameter(pname, param)
        self._partition_sizes = self._cut_sizes()
        self._mark_uc_metadata()

    def _initial_shard(
        self, pname: str, layout: ShardLayout, data: torch.Tensor, shape: tuple[int, ...]
    ) -> torch.Tensor:
        """This rank's shard of the module's `data`. A ZeRO-3 parameter whose local data is gone (empty,
        its whole shape in `ds_shape`) is kept as it is when nothing is cut; it cannot be cut here."""
        if data.numel() == 0 and tuple(data.shape) != shape:
            if self.tp_world_size == 1:
                return data
            raise ValueError(
                f"AutoTP: layer {self.name!r}: {pname} holds no data (ZeRO-3 partitioned, whole shape {shape}); "
                "gather it before cutting it over the tensor-parallel ranks"
            )
        return layout.shard(data, self.tp_index)

    # -- the cut, frozen -------------------------------------------------------------------------------
    def _cut_sizes(self) -> tuple[int, ...]:
        """Every rank's share of the weight's cut dim (the whole dim, once, when not cut)."""
        layout = self.layouts["weight"]
        if layout.replicated:
            return (self._orig_shapes["weight"][0],)
        return layout.local_sizes()

    def _freeze_partition_sizes(self, total_size: int) -> tuple[int, ...]:
        """Decide the cut again for the current `tp_world_size` (DeepSpeed's hook; layers call it once, when
        built) and return every rank's share of the weight's cut dim, of `total_size` elements."""
        layouts = {pname: self._layout(pname, shape) for pname, shape in self._orig_shapes.items()}
        weight = layouts["weight"]
        if not weight.replicated and weight.full_size != total_size:
            raise ValueError(
                f"AutoTP: layer {self.name!r}: its weight's cut dim has {weight.full_size} elements, not {total_size}"
            )
        self.layouts = layouts
        self._partition_sizes = self._cut_sizes()
        return self._partition_sizes

    def _mark_uc_metadata(self) -> None:
        """Record on each parameter how it is cut (`ds_autotp_universal_checkpoint_meta`, DeepSpeed's schema):
        what universal-checkpoint conversion and restore read. Re-run after the shards change."""
        for pname, layout in self.layouts.items():
            mark_param_from_layout(
                getattr(self, pname),
                layout,
                self._orig_shapes[pname],
                partition_type=self._uc_partition_type,
                is_bias=pname == "bias",
                unsupported_reason=self._unsupported_uc_reason,
            )

    # -- what subclasses decide -----------------------------------------------------------------------
    def _layout(self, pname: str, shape: tuple[int, ...]) -> ShardLayout:
        raise NotImplementedError

    def _split(self, total: int, name: str | None = None) -> tuple[int, ...]:
        return shard_sizes(total, self.tp_world_size, self.tp_meta, self.name if name is None else name)

    # -- whole weights -------------------------------------------------------------------------------
    def full_tensor(self, pname: str) -> torch.Tensor:
        """The whole parameter `pname` ("weight"/"bias"), gathered from the group (collective when cut)."""
        return self.full_like(pname, getattr(self, pname))

    def full_like(self, pname: str, local: torch.Tensor) -> torch.Tensor:
        """The whole tensor of which `local` is this rank's shard, cut as parameter `pname` is (collective
        when cut). For state that follows a parameter's layout: its fp32 master, its optimizer moments."""
        layout = self.layouts[pname]
        if layout.replicated or self.mp_group is None or self.tp_world_size == 1:
            return local.detach().clone()
        assert layout.dim is not None
        stacked = all_gather_along(local.detach(), layout.local_sizes(), layout.dim, self.mp_group)
        shards = list(stacked.split(layout.local_sizes(), dim=layout.dim))
        return layout.unshard(shards)

    def shard_like(self, pname: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the whole tensor `full`, cut as parameter `pname` is (no communication)."""
        return self.layouts[pname].shard(full, self.tp_index)

    @torch.no_grad()
    def load_full(self, pname: str, full: torch.Tensor) -> None:
        """Copy this rank's shard of the whole parameter `full` into `pname` (no communication)."""
        getattr(self, pname).copy_(self.shard_like(pname, full))

    @torch.no_grad()
    def gather_params(self, params_list: list[torch.Tensor | None]) -> None:
        """DeepSpeed's hook: swap each listed parameter's data for the whole tensor (collective).

        The shard's storage is kept aside: `_tp_partition` writes the shard back into it, so a parameter
        that is a view of an optimizer's flat buffer (ZeRO 1/2) stays one."""
        for pname in self.layouts:
            param = getattr(self, pname)
            if any(p is param for p in params_list if p is not None):
                shard = param.data
                param.data = self.full_tensor(pname)
                self._shard_storage[pname] = shard

    @torch.no_grad()
    def _tp_partition(self, params_list: list[torch.Tensor | None]) -> None:
        """DeepSpeed's hook: cut whole parameters (after `gather_params`) back to this rank's shard."""
        for pname, layout in self.layouts.items():
            param = getattr(self, pname)
            if any(p is param for p in params_list if p is not None) and not layout.replicated:
                if param.shape[layout.dim] == layout.full_size:
                    shard = layout.shard(param.data, self.tp_index)
                    storage = self._shard_storage.pop(pname, None)
                    if storage is not None and storage.shape == shard.shape:
                        storage.copy_(shard)
                        shard = storage
                    param.data = shard

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, name={self.name!r}, "
            f"tp_rank={self.tp_index}/{self.tp_world_size}, local_weight={tuple(self.weight.shape)}"
        )


class LinearLayer(TensorParallelLayer):
    """Column-parallel: the output features are split (weight and bias by rows).

    Forward: `y_local = x @ W_local.T + b_local` on the replicated input, no communication; in
    training the backward all-reduces the input gradient over the group. With `gather_output=True`
    (DeepSpeed's flag; a Hugging Face plan's `colwise_gather_output`) the local outputs are then
    all-gathered, so every rank gets the whole output (one all_gather per forward).
    """

    def __init__(
        self, module: nn.Linear, mp_group: ProcessGroup | None, *, gather_output: bool = False, **kwargs: object
    ) -> None:
        self.gather_output = gather_output
        super().__init__(module, mp_group, **kwargs)  # type: ignore[arg-type]

    def _layout(self, pname: str, shape: tuple[int, ...]) -> ShardLayout:
        return ShardLayout(0, (self._split(shape[0]),))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp_region(x, self.mp_group, self.training_mode)
        out = F.linear(x, self.weight, self.bias)
        if self.gather_output and self.tp_world_size > 1:
            sizes = self.layouts["weight"].local_sizes()
            out = gather_from_tp_region(out, sizes, self.tp_index, self.mp_group, self.training_mode)
        return out

    def extra_repr(self) -> str:
        return super().extra_repr() + (", gather_output=True" if self.gather_output else "")


class LinearAllreduce(TensorParallelLayer):
    """Row-parallel: the input features are split; partial outputs are all-reduced, then the bias added.

    The bias is replicated (added once, after the sum). Collective: one all_reduce of the output on
    the group per forward.
    """

    _uc_partition_type = "row"

    def _layout(self, pname: str, shape: tuple[int, ...]) -> ShardLayout:
        if pname == "bias":
            return ShardLayout(None)
        return ShardLayout(1, (self._split(shape[1]),))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = reduce_from_tp_region(F.linear(x, self.weight), self.mp_group, self.training_mode)
        return out if self.bias is None else out + self.bias


class LmHeadLinearAllreduce(LinearAllreduce):
    """The output head row-parallel over the hidden size, its replicated input sliced locally.

    AutoTP's inference head, and a plan's `rowwise` head in training (DeepSpeed's
    `LinearAllreduceWithReplicatedInput`): in training the backward all-reduces the input gradient,
    since each rank's slice only reaches its part of the input. Its weight is copied first, so an
    input embedding tied to the head stays whole.
    """

    def __init__(self, module: nn.Linear, mp_group: ProcessGroup | None, **kwargs: object) -> None:
        kwargs["name"] = "lm_head"  # the head splits near evenly, never by attention heads
        super().__init__(module, mp_group, **kwargs)  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The input is cut as the weight was, by the sizes frozen with the layout (never re-derived here).
        sizes = self.layouts["weight"].local_sizes()
        if sum(sizes) != x.shape[-1]:
            raise ValueError(f"AutoTP: output head cut for {sum(sizes)} input features, got {x.shape[-1]}")
        x = copy_to_tp_region(x, self.mp_group, self.training_mode)
        local = x.narrow(-1, sum(sizes[: self.tp_index]), sizes[self.tp_index])
        return super().forward(local)


class _SectionedColumn(LinearLayer):
    """Column-parallel over several sections stacked along the output features."""

    def _sections(self, total: int) -> tuple[int, ...]:
        raise NotImplementedError

    def _layout(self, pname: str, shape: tuple[int, ...]) -> ShardLayout:
        sections = self._sections(shape[0])
        if sum(sections) != shape[0]:
            raise ValueError(f"AutoTP: layer {self.name!r}: sections {sections} do not tile {shape[0]} features")
        return ShardLayout(0, tuple(self._split(s) for s in sections))


class FusedQKVLinearLayer(_SectionedColumn):
    """A fused query/key/value projection (`qkv_proj`, `query_key_value`, `c_attn`, `Wqkv`, `W_pack`).

    Two layouts, chosen by the block's type as DeepSpeed does: `interleaved=False` is [q | k | v] along
    the outputs (q with `num_attention_heads` heads, k and v with `num_key_value_heads`), each section
    split by heads, so every rank computes whole heads of all three (Phi-3, GLM-style blocks);
    `interleaved=True` keeps each head's q, k and v together (Bloom, Falcon) and splits the whole
    output dimension by heads.
    """

    def __init__(
        self, module: nn.Linear, mp_group: ProcessGroup | None, *, interleaved: bool = False, **kwargs: object
    ) -> None:
        self.interleaved = interleaved
        super().__init__(module, mp_group, **kwargs)  # type: ignore[arg-type]

    def _sections(self, total: int) -> tuple[int, ...]:
        m = self.tp_meta
        if self.interleaved:
            return (total,)
        if m.num_attention_heads and m.num_kv_heads and m.hidden_size and m.num_kv_heads != m.num_attention_heads:
            kv = m.num_kv_heads * (m.hidden_size // m.num_attention_heads)
            return (total - 2 * kv, kv, kv)
        if total % 3:
            raise ValueError(f"AutoTP: fused qkv layer {self.name!r} has {total} outputs, not three equal parts")
        return (total // 3,) * 3

    def _split(self, total: int, name: str | None = None) -> tuple[int, ...]:
        m = self.tp_meta
        heads = m.num_kv_heads
        if not self.interleaved and m.num_attention_heads and m.hidden_size and total == m.hidden_size:
            heads = m.num_attention_heads  # the q section
        if heads and total % heads == 0:
            world = self.tp_world_size
            return tuple(total * (heads // world + (1 if r < heads % world else 0)) // heads for r in range(world))
        return super()._split(total, name)


class GateUpPackLinearLayer(_SectionedColumn):
    """A packed gate/up MLP projection (`gate_up_proj`): two equal halves, each split near evenly."""

    def _sections(self, total: int) -> tuple[int, ...]:
        if total % 2:
            raise ValueError(f"AutoTP: packed gate_up layer {self.name!r} has an odd number of outputs ({total})")
        return (total // 2, total // 2)
