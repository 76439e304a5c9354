"""The collectives DeepCompile puts in a graph, as torch.library custom ops a traced graph can hold.

* `ds_zero::allgather_param(placeholder, ds_id)`: this rank's shard of parameter `ds_id` all-gathered over
  its `ds_process_group` into a new tensor of the full shape. `placeholder` is the partitioned
  `nn.Parameter` itself (released: a stride-0 tensor of the full shape): it gives the graph the shape and
  the autograd edge, and its values are never read. The gradient of the output flows to the parameter
  unchanged (a full gradient on `param.grad`, which stage 3's gradient reducer reduce-scatters as in eager).
* `ds_zero::release_param(full, ds_id)`: the point after the last use of a gathered parameter. It returns
  nothing and is marked side-effecting, so no dead-code elimination removes it; once it ran the graph
  holds no reference to the gathered tensor, which is freed by its reference count (inductor and FX code
  free a value after its last user, and this op is that user). It counts the release for the schedule's
  bookkeeping (`GatherStats`).

* `ds_zero::allgather_start(placeholders, ds_ids)` / `ds_zero::allgather_wait(token, placeholder, ds_id)`:
  the same gather split in two so that it overlaps computation (the `overlap` pass places them). The start
  issues one asynchronous collective for all the listed parameters (a bucket) and returns a token (a
  one-element int64 tensor naming the in-flight entry); each parameter's wait, placed just before its first
  use, finishes the collective (the first wait of a bucket does) and returns that parameter's full tensor,
  as `allgather_param` does. The start is marked side-effecting, so no pass removes or sinks it.

Shards are found by `ds_id` in a registry of weak references the backend fills (`register_params`), so
the graph carries only integers besides the parameters.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

import ds_comm
from ds_zero._params.shards import shard_values

logger = logging.getLogger(__name__)

__all__ = [
    "GatherStats",
    "allgather_param",
    "allgather_start",
    "allgather_wait",
    "register_params",
    "release_param",
    "stats",
]

_PARAMS: dict[int, weakref.ReferenceType[nn.Parameter]] = {}


@dataclasses.dataclass
class GatherStats:
    """Counts of the ops' runs (reset with `reset()`): what a test or benchmark checks the schedule did."""

    gathers: int = 0
    releases: int = 0
    gathered_numel: int = 0
    collectives: int = 0  # gather collectives issued (a bucket of several parameters is one)
    max_inflight: int = 0  # most started-and-not-yet-waited buckets at once

    def reset(self) -> None:
        self.gathers = self.releases = self.gathered_numel = self.collectives = self.max_inflight = 0


stats = GatherStats()


def register_params(params: Iterable[nn.Parameter]) -> None:
    """Make the partitioned `params` reachable from the ops by their `ds_id`."""
    for p in params:
        _PARAMS[int(p.ds_id)] = weakref.ref(p)


def _param(ds_id: int) -> nn.Parameter:
    ref = _PARAMS.get(ds_id)
    param = ref() if ref is not None else None
    if param is None:
        raise RuntimeError(f"DeepCompile: no partitioned parameter with ds_id={ds_id} is registered")
    return param


@torch.library.custom_op("ds_zero::allgather_param", mutates_args=())
def allgather_param(placeholder: torch.Tensor, ds_id: int) -> torch.Tensor:
    param = _param(ds_id)
    shard = shard_values(param).reshape(-1)
    group = param.ds_process_group
    world = ds_comm.get_world_size(group)
    if shard.device != placeholder.device or shard.dtype != placeholder.dtype:
        shard = shard.to(device=placeholder.device, dtype=placeholder.dtype)
    flat = shard.new_empty(world * shard.numel())
    if world == 1:
        flat.copy_(shard)
    else:
        ds_comm.all_gather_into_tensor(flat, shard.contiguous(), group=group)
    stats.gathers += 1
    stats.gathered_numel += int(param.ds_numel)
    return flat.narrow(0, 0, int(param.ds_numel)).view(placeholder.shape)


@allgather_param.register_fake
def _(placeholder: torch.Tensor, ds_id: int) -> torch.Tensor:
    return placeholder.new_empty(placeholder.shape)


def _gather_backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return grad, None


allgather_param.register_autograd(_gather_backward)


@torch.library.custom_op("ds_zero::release_param", mutates_args=())
def release_param(full: torch.Tensor, ds_id: int) -> None:
    stats.releases += 1


@release_param.register_fake
def _(full: torch.Tensor, ds_id: int) -> None:
    return None


torch.fx.node.has_side_effect(torch.ops.ds_zero.release_param.default)


@dataclasses.dataclass
class _Inflight:
    """One started bucket: the collective's handle and, per parameter, its gathered (padded) flat tensor."""

    handle: Any
    flats: dict[int, torch.Tensor]
    unpack: Any = None  # the general path's copy out of the rank-major receive buffer, run after the wait


_INFLIGHT: dict[int, _Inflight] = {}
_KEYS = itertools.count()


def _issue(params: list[nn.Parameter], like: list[torch.Tensor]) -> _Inflight:
    shards = []
    for p, ref in zip(params, like, strict=True):
        shard = shard_values(p).reshape(-1)
        if shard.device != ref.device or shard.dtype != ref.dtype:
            shard = shard.to(device=ref.device, dtype=ref.dtype)
        shards.append(shard.contiguous())
    group = params[0].ds_process_group
    world = ds_comm.get_world_size(group)
    flats = [s.new_empty(world * s.numel()) for s in shards]
    by_id = {int(p.ds_id): f for p, f in zip(params, flats, strict=True)}
    if world == 1:
        for f, s in zip(flats, shards, strict=True):
            f.copy_(s)
        return _Inflight(None, by_id)
    stats.collectives += 1
    if len(params) == 1:
        return _Inflight(ds_comm.all_gather_into_tensor(flats[0], shards[0], group=group, async_op=True), by_id)
    handle = ds_comm.pair_all_gather_into_tensors(flats, shards, group=group)
    if handle is not None:  # two gloo ranks: one exchange straight into each parameter's tensor
        return _Inflight(handle, by_id)
    sizes = [s.numel() for s in shards]
    recv = shards[0].new_empty(world * sum(sizes))
    handle = ds_comm.all_gather_into_tensor(recv, torch.cat(shards), group=group, async_op=True)

    def unpack() -> None:  # rank-major [rank r: shard of each parameter] -> each parameter's [r0 | r1 | ...]
        offset = 0
        rows = recv.view(world, -1)
        for f, n in zip(flats, sizes, strict=True):
            f.view(world, n).copy_(rows[:, offset : offset + n])
            offset += n

    return _Inflight(handle, by_id, unpack)


@torch.library.custom_op("ds_zero::allgather_start", mutates_args=())
def allgather_start(placeholders: list[torch.Tensor], ds_ids: list[int]) -> torch.Tensor:
    params = [_param(i) for i in ds_ids]
    groups = {id(p.ds_process_group) for p in params}
    if len(groups) != 1:
        raise RuntimeError(f"DeepCompile: a gather bucket spans {len(groups)} process groups (ds_ids {ds_ids})")
    key = next(_KEYS)
    _INFLIGHT[key] = _issue(params, placeholders)
    stats.max_inflight = max(stats.max_inflight, len(_INFLIGHT))
    return torch.tensor([key], dtype=torch.int64)


@allgather_start.register_fake
def _(placeholders: list[torch.Tensor], ds_ids: list[int]) -> torch.Tensor:
    return torch.empty((1,), dtype=torch.int64)


torch.fx.node.has_side_effect(torch.ops.ds_zero.allgather_start.default)


@torch.library.custom_op("ds_zero::allgather_wait", mutates_args=())
def allgather_wait(token: torch.Tensor, placeholder: torch.Tensor, ds_id: int) -> torch.Tensor:
    key = int(token[0])
    entry = _INFLIGHT.get(key)
    if entry is None or ds_id not in entry.flats:
        raise RuntimeError(f"DeepCompile: no gather of ds_id={ds_id} in flight under token {key}")
    if entry.handle is not None:
        entry.handle.wait()
        entry.handle = None
    if entry.unpack is not None:
        entry.unpack()
        entry.unpack = None
    flat = entry.flats.pop(ds_id)
    if not entry.flats:
        del _INFLIGHT[key]
    param = _param(ds_id)
    stats.gathers += 1
    stats.gathered_numel += int(param.ds_numel)
    return flat.narrow(0, 0, int(param.ds_numel)).view(placeholder.shape)


@allgather_wait.register_fake
def _(token: torch.Tensor, placeholder: torch.Tensor, ds_id: int) -> torch.Tensor:
    return placeholder.new_empty(placeholder.shape)
