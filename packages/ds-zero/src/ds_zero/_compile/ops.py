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

Shards are found by `ds_id` in a registry of weak references the backend fills (`register_params`), so
the graph carries only integers besides the parameters.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Iterable

import torch
from torch import nn

import ds_comm
from ds_zero._params.shards import shard_values

logger = logging.getLogger(__name__)

__all__ = ["GatherStats", "allgather_param", "register_params", "release_param", "stats"]

_PARAMS: dict[int, weakref.ReferenceType[nn.Parameter]] = {}


@dataclasses.dataclass
class GatherStats:
    """Counts of the ops' runs (reset with `reset()`): what a test or benchmark checks the schedule did."""

    gathers: int = 0
    releases: int = 0
    gathered_numel: int = 0

    def reset(self) -> None:
        self.gathers = self.releases = self.gathered_numel = 0


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
