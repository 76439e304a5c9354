"""Partial optimizer offload (`offload_optimizer.ratio` < 1): some sub-groups stay on the accelerator.

DeepSpeed 0.19.8's rule, kept here: the sub-groups (tiles) are counted in the base optimizer's order over
all param groups, n in all; the first `int((1 - ratio) * n)` keep their fp32 master, gradient partition
and optimizer state on the accelerator and are stepped there; the rest are offloaded to the CPU and
stepped by the CPU optimizer (with SuperOffload, during the backward). So `ratio` is the share of the
sub-groups, not of the elements, that the CPU holds.

A param group whose tiles fall on both sides is built as two partitions (its device head, its CPU tail),
cut at a tile boundary, so each has one flat master on one device; their tiles are the same tiles the
whole group would have had, in the same order, so the base optimizer's parameters and the checkpoint
layout do not change with `ratio`.

The device tiles are stepped by a *device twin* of the base optimizer that shares its param groups and
its state mapping (one `optimizer.state`, so checkpoints, `get_full_hp_param` and friends see every
tile): for `DeepSpeedCPUAdam` (the optimizer DeepSpeed requires here) it is `ds_ops.FusedAdam`, whose
state has the same keys and per-parameter step and whose CPU path runs the same kernel, so the numbers
do not depend on where a tile lives; a torch optimizer steps any device's tensors itself (no twin).
Other ds-ops CPU-only optimizers are refused.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

import ds_comm
from ds_ops import DeepSpeedCPUAdagrad, DeepSpeedCPUAdam, DeepSpeedCPULion, FusedAdam
from ds_zero._params.partitioned_param import state_of

logger = logging.getLogger(__name__)

__all__ = ["TilePlacement", "device_tile_counts", "tile_bounds"]


def tile_bounds(sizes: list[int], tile_numel: int) -> list[tuple[int, int]]:
    """The tiles of a partition whose shards have `sizes`: `(first, last)` parameter index ranges, cut on
    parameter boundaries so a tile holds at most `tile_numel` elements (a larger shard is a tile of its own)."""
    if not sizes:
        return [(0, 0)]
    bounds = []
    first, total = 0, 0
    for i, size in enumerate(sizes):
        total += size
        nxt = sizes[i + 1] if i + 1 < len(sizes) else 0
        if i + 1 == len(sizes) or total + nxt > tile_numel:
            bounds.append((first, i + 1))
            first, total = i + 1, 0
    return bounds


def device_tile_counts(group_sizes: list[list[int]], tile_numel: int, ratio: float) -> list[int]:
    """Per param group, how many of its leading tiles stay on the accelerator (DeepSpeed's rule above)."""
    counts = [len(tile_bounds(sizes, tile_numel)) for sizes in group_sizes]
    keep = int((1.0 - ratio) * sum(counts))
    out = []
    for count in counts:
        take = min(count, keep)
        out.append(take)
        keep -= take
    return out


def _device_twin(base: torch.optim.Optimizer) -> torch.optim.Optimizer | None:
    """The optimizer that steps the device tiles (None: the base steps any device's tensors itself)."""
    if isinstance(base, DeepSpeedCPUAdam):
        device = ds_comm.get_accelerator().device()
        twin = FusedAdam([torch.zeros(1, device=device)], adam_w_mode=base.adam_w_mode)  # loads the device's op
        twin.param_groups = base.param_groups  # shared: the same groups (narrowed per tile) and hyper-parameters
        twin.state = base.state  # shared: one state mapping for every tile
        return twin
    return None


class TilePlacement:
    """Where each tile's master, gradient and optimizer state live, and which optimizer steps it.

    With full offload (or none) every tile is on one side and this only answers the trivial questions.

    Args:
        base: the base optimizer (the CPU optimizer under offload).
        config: the `zero_optimization` section (`offload_optimizer.ratio`, `sub_group_size`).
        model_parallel: a tensor-parallel group is given (partial offload is refused with it).
    """

    def __init__(self, base: torch.optim.Optimizer, config: Any, *, model_parallel: bool = False) -> None:
        off = config.offload_optimizer_or_default
        self.base = base
        self.ratio = float(off.ratio) if config.offload_optimizer_device == "cpu" else 1.0
        self.tile_numel = max(1, int(config.sub_group_size))
        self.partial = self.ratio < 1.0
        if self.partial and model_parallel:
            raise ValueError(
                "zero_optimization.offload_optimizer.ratio < 1 (partial offload) is not supported with tensor "
                "parallelism in ds; set ratio to 1"
            )
        if self.partial and any(g.get("use_muon", False) for g in base.param_groups):
            raise ValueError(
                "zero_optimization.offload_optimizer.ratio < 1 (partial offload) is not supported with Muon "
                "(param groups with use_muon=True); set ratio to 1"
            )
        if self.partial and isinstance(base, (DeepSpeedCPUAdagrad, DeepSpeedCPULion)):  # the CPU-only kernels
            raise ValueError(
                f"zero_optimization.offload_optimizer.ratio < 1 (partial offload) needs an optimizer that also runs "
                f"on the accelerator; {type(base).__name__} runs on the CPU only. Use Adam/AdamW (DeepSpeedCPUAdam, as "
                "DeepSpeed requires) or a torch optimizer, or set ratio to 1"
            )
        self.twin: torch.optim.Optimizer | None = None
        self.device_tiles: list[Any] = []
        self.cpu_tiles: list[Any] = []
        self._device_ids: set[int] = set()

    def split(self, trainable_by_group: list[list[Any]]) -> list[list[tuple[list[Any], bool]]]:
        """Per param group, its parameters as `(params, on_device)` pieces: one piece, or a device head and a
        CPU tail cut at a tile boundary."""
        if not self.partial:
            return [[(params, False)] for params in trainable_by_group]
        sizes = [[state_of(p).shard_numel for p in params] for params in trainable_by_group]
        keep = device_tile_counts(sizes, self.tile_numel, self.ratio)
        out = []
        for params, group_sizes, k in zip(trainable_by_group, sizes, keep, strict=True):
            cut = tile_bounds(group_sizes, self.tile_numel)[k - 1][1] if k else 0
            pieces = [(params[:cut], True)] if cut else []
            if cut < len(params) or not pieces:
                pieces.append((params[cut:], False))
            out.append(pieces)
        return out

    def place(self, parts: list[Any], on_device: list[bool]) -> None:
        """Record the built partitions of one group (in `split`'s order)."""
        for part, dev in zip(parts, on_device, strict=True):
            (self.device_tiles if dev else self.cpu_tiles).extend(part.tiles)
            if dev:
                self._device_ids.update(id(t) for t in part.tiles)
                if self.twin is None:
                    self.twin = _device_twin(self.base)

    def on_device(self, tile: Any) -> bool:
        return id(tile) in self._device_ids

    def optimizer_for(self, tiles: list[Any]) -> torch.optim.Optimizer:
        """The optimizer that steps `tiles` (all on one side)."""
        if self.twin is not None and any(id(t) in self._device_ids for t in tiles):
            if not all(id(t) in self._device_ids for t in tiles):
                raise AssertionError("partial offload: device and CPU tiles are stepped separately")
            # re-linked each time: torch's load_state_dict replaces the base's groups list and state mapping
            self.twin.param_groups = self.base.param_groups
            self.twin.state = self.base.state
            return self.twin
        return self.base

    def masters_by_group(self, partitions: list[Any]) -> dict[int, list[torch.Tensor]]:
        """Each param group's tile masters over all its partitions (the base optimizer's `params`)."""
        out: dict[int, list[torch.Tensor]] = {}
        for part in partitions:
            out.setdefault(part.group_index, []).extend(tile.master for tile in part.tiles)
        return out

    def grads_by_group(self, partitions: list[Any]) -> list[list[torch.Tensor | None]]:
        """Each param group's gradient partitions (one per partition of the group), in group order."""
        out: dict[int, list[torch.Tensor | None]] = {}
        for part in partitions:
            out.setdefault(part.group_index, []).append(part.master.grad)
        return list(out.values())

    def adopt_state(self) -> None:
        """After a load: the device tiles' state tensors to their master's device (the loader builds them on
        the host)."""
        for tile in self.device_tiles:
            state = self.base.state.get(tile.master)
            if not state:
                continue
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.device != tile.master.device:
                    state[key] = value.to(tile.master.device)

    def describe(self) -> str:
        return (
            f"{len(self.device_tiles)} of {len(self.device_tiles) + len(self.cpu_tiles)} sub-groups on the "
            f"accelerator (offload_optimizer.ratio={self.ratio:g})"
        )
