"""Linear layers whose weight is several sub-parameters, each cut over the ranks on its own.

DeepSpeed's `SubParamLinearLayer` / `SubParamLinearAllreduce`: `shape` views the weight as a logical
tensor (its last dim the input features) and names, at `partition_dim`, the sub-parameters along that
dim: `(3, -1)` is three equal parts of the output features, `((q, k, v), -1)` three given sizes, `(-1, n)`
one part. Each sub-parameter is split by the usual rules and a rank holds its piece of every one, in order,
so fused q/k/v or gate/up weights keep whole heads / halves per rank.

The logical cut is turned into a `ShardLayout` of the real 2-D weight (a cut of an output dim is a sequence
of sections along dim 0, one per sub-parameter per outer index; a cut of the input dim is sections along
dim 1), so gathering, whole-weight loading and checkpoint conversion work as for every other layer.
The per-rank widths are frozen in `_subparam_shard_widths` (DeepSpeed's attribute name).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from ds_parallel.tensor._layers import LinearAllreduce, LinearLayer
from ds_parallel.tensor._layout import ShardLayout
from ds_parallel.tensor._uc_meta import DS_AUTOTP_UC_META, build_param_uc_restore_meta, subparam_shard_widths

__all__ = ["SubParamLinearAllreduce", "SubParamLinearLayer", "parse_subparam_shape"]


def _as_tuple(spec: Any) -> Any:
    return tuple(_as_tuple(x) for x in spec) if isinstance(spec, (list, tuple)) else spec


def parse_subparam_shape(
    weight_shape: tuple[int, ...], shape: Any, partition_dim: int, name: str = ""
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...] | None]:
    """`(logical_shape, output_shape, sub_param_sizes)` of a weight viewed by `shape` and cut at `partition_dim`.

    `sub_param_sizes` is None when `shape` names no sub-parameters there (`-1`: the dim is one part).
    Raises ValueError naming the layer when `shape` does not describe the weight.
    """
    label = f"AutoTP layer {name!r}" if name else "AutoTP layer"
    spec = _as_tuple(shape)
    if not isinstance(spec, tuple):
        raise ValueError(f"{label}: shape must be a tuple, got {shape!r}")
    if not 0 <= partition_dim < len(spec):
        raise ValueError(f"{label}: partition_dim {partition_dim} is out of range for shape {spec}")
    dims: list[int | None] = []
    sizes: tuple[int, ...] | None = None
    count = None
    for i, d in enumerate(spec):
        if i == partition_dim and isinstance(d, tuple):
            if not d or any(not isinstance(v, int) or v <= 0 for v in d):
                raise ValueError(f"{label}: sub-parameter sizes {d} must be positive integers")
            sizes = d
            dims.append(sum(d))
        elif isinstance(d, int) and (d > 0 or d == -1):
            if i == partition_dim and d > 0:
                count, d = d, -1  # a positive entry at the cut dim counts equal sub-parameters
            dims.append(None if d == -1 else d)
        else:
            raise ValueError(
                f"{label}: shape entry {d!r} must be a positive integer or -1 (a size tuple at the cut dim)"
            )
    numel = math.prod(weight_shape)
    known = math.prod(d for d in dims if d is not None)
    unknown = [i for i, d in enumerate(dims) if d is None]
    if len(unknown) == 1 and known and numel % known == 0:
        dims[unknown[0]] = numel // known
    elif len(unknown) > 1 and len(spec) == len(weight_shape):
        for i in unknown:
            dims[i] = weight_shape[i]
    elif unknown:
        raise ValueError(f"{label}: shape {spec} cannot be inferred for a weight of shape {weight_shape}")
    logical = tuple(int(d) for d in dims if d is not None)
    if math.prod(logical) != numel or logical[-1] != weight_shape[-1] or len(logical) < 2:
        raise ValueError(f"{label}: shape {spec} (logical {logical}) does not view a weight of shape {weight_shape}")
    if count is not None:
        if logical[partition_dim] % count:
            raise ValueError(f"{label}: {logical[partition_dim]} features do not split into {count} sub-parameters")
        sizes = (logical[partition_dim] // count,) * count
    return logical, logical[:-1], sizes


class _SubParamCut:
    """What both sub-parameter layers share: the logical view, its frozen widths, and their layouts."""

    shape: Any
    partition_dim: int
    tp_world_size: int
    tp_meta: Any
    name: str
    layouts: dict[str, ShardLayout]
    _orig_shapes: dict[str, tuple[int, ...]]
    _uc_partition_type: str
    _logical_shape: tuple[int, ...]
    _output_shape: tuple[int, ...]
    _subparam_sizes: tuple[int, ...] | None
    _subparam_shard_widths: Any

    def _parts(self) -> tuple[int, ...]:
        return self._subparam_sizes or (self._logical_shape[self.partition_dim],)

    def _bias_partition_dim(self) -> int | None:
        return self.partition_dim if self.partition_dim < len(self._output_shape) else None

    def _layout(self, pname: str, shape: tuple[int, ...]) -> ShardLayout:
        if pname == "weight":  # decide the view and freeze the widths for the current group size
            self._logical_shape, self._output_shape, self._subparam_sizes = parse_subparam_shape(
                shape, self.shape, self.partition_dim, self.name
            )
            self._subparam_shard_widths = subparam_shard_widths(
                self._parts(), self.tp_world_size, self.tp_meta, self.name
            )
            if self._uc_partition_type == "row" and self._bias_partition_dim() is not None:
                raise ValueError(f"AutoTP layer {self.name!r}: a row-parallel layer must cut its input (last) dim")
        return self._physical_layout(pname)

    def _physical_layout(self, pname: str) -> ShardLayout:
        """The frozen widths as a cut of the real parameter (see the module docstring)."""
        widths = [tuple(int(w) for w in per_rank) for per_rank in self._subparam_shard_widths]
        if len(widths) != len(self._parts()) or any(sum(w) != s for w, s in zip(widths, self._parts(), strict=True)):
            raise ValueError(f"AutoTP layer {self.name!r}: shard widths {widths} do not tile {self._parts()}")
        p = self.partition_dim
        if pname == "bias" and (self._uc_partition_type == "row" or self._bias_partition_dim() is None):
            return ShardLayout(None)
        if pname == "weight" and p == len(self._logical_shape) - 1:
            return ShardLayout(1, tuple(widths))
        outer, inner = math.prod(self._output_shape[:p]), math.prod(self._output_shape[p + 1 :])
        return ShardLayout(0, tuple(tuple(w * inner for w in per_rank) for _ in range(outer) for per_rank in widths))

    def _sync_layouts(self) -> None:
        self.layouts = {pname: self._physical_layout(pname) for pname in self._orig_shapes}

    def _mark_uc_metadata(self) -> None:
        """DeepSpeed's sub-parameter schema: the user's view spec, the sizes and the frozen widths."""
        self._sync_layouts()
        widths = [list(w) for w in self._subparam_shard_widths]
        weight = self.weight  # type: ignore[attr-defined]
        row = self._uc_partition_type == "row"
        setattr(
            weight,
            DS_AUTOTP_UC_META,
            build_param_uc_restore_meta(
                partition_type=self._uc_partition_type,
                partition_dim=self.partition_dim,
                logical_shape=self._logical_shape,
                output_shape=self._output_shape,
                sub_param_shape=_as_tuple(self.shape),
                sub_param_sizes=self._subparam_sizes,
                sub_param_shard_widths=widths,
                target_partition_shape=tuple(weight.shape),
                original_shape=self._orig_shapes["weight"],
            ),
        )
        bias = self.bias  # type: ignore[attr-defined]
        if bias is None:
            return
        bias_dim = None if row else self._bias_partition_dim()
        spec: list[Any] | None = None
        if bias_dim is not None:
            spec = list(self._output_shape)
            if self._subparam_sizes is not None:
                spec[bias_dim] = self._subparam_sizes
        cut = bias_dim is not None
        bias_shape = self._orig_shapes["bias"]
        setattr(
            bias,
            DS_AUTOTP_UC_META,
            build_param_uc_restore_meta(
                partition_type=self._uc_partition_type,
                partition_dim=bias_dim,
                logical_shape=bias_shape if row else self._output_shape,
                output_shape=bias_shape if row else self._output_shape,
                sub_param_shape=spec,
                sub_param_sizes=self._subparam_sizes if cut else None,
                sub_param_shard_widths=widths if cut else None,
                target_partition_shape=tuple(bias.shape),
                original_shape=bias_shape,
                is_bias=True,
                replicated=not cut,
            ),
        )

    @torch.no_grad()
    def _tp_partition(self, params_list: list[torch.Tensor | None]) -> None:
        self._sync_layouts()
        super()._tp_partition(params_list)  # type: ignore[misc]


class SubParamLinearLayer(_SubParamCut, LinearLayer):
    """Column-parallel over sub-parameters (`partition_dim` an output dim of the view; the bias cut alike)."""

    def __init__(
        self, module: nn.Linear, mp_group: ProcessGroup | None, shape: Any, partition_dim: int = 0, **kwargs: Any
    ) -> None:
        self.shape, self.partition_dim = shape, partition_dim
        super().__init__(module, mp_group, **kwargs)


class SubParamLinearAllreduce(_SubParamCut, LinearAllreduce):
    """Row-parallel over sub-parameters of the input features (`partition_dim` the view's last dim); the
    partial outputs are all-reduced and the replicated bias added once."""

    def __init__(
        self, module: nn.Linear, mp_group: ProcessGroup | None, shape: Any, partition_dim: int = 1, **kwargs: Any
    ) -> None:
        self.shape, self.partition_dim = shape, partition_dim
        super().__init__(module, mp_group, **kwargs)
