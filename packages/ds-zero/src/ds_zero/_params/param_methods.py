"""DeepSpeed's methods on each partitioned parameter: `all_gather`, `all_gather_coalesced`, `partition`,
`partition_numel`, `ds_summary`.

Code written against DeepSpeed gathers parameters by hand with these (`p.all_gather()`, then `p.partition()`)
where `GatheredParameters` would be the block form. Here they are the same operation split in two: the
gather holds the parameters (as a `GatheredParameters` entry does, so a running forward does not release
them) until `partition()` lets go. A parameter is held at most once by these methods; gathering it again
before `partition()` changes nothing.

`partition(has_been_updated=True)` keeps what the caller wrote into the full value: each rank writes its
slice of its own full copy into its shard (and the optimizer's fp32 master), so every rank must have
written the same values, as in DeepSpeed. The gathers are collectives over the parameters' group: every
rank calls them for the same parameters in the same order.
"""

from __future__ import annotations

import types
from collections.abc import Iterable
from typing import Any

from torch import nn

from ds_zero._params.gathered_parameters import hold_gathered, release_held
from ds_zero._params.partitioned_param import state_of

__all__ = ["GatheredHandle", "bind_param_methods"]


class GatheredHandle:
    """What `all_gather(async_op=True)` / `all_gather_coalesced` return: the gather is complete already,
    so `wait()` returns at once (DeepSpeed's handle may still be in flight there)."""

    def wait(self, handle_dependency: bool = True) -> None:
        del handle_dependency


def _params(param: nn.Parameter, param_list: Iterable[nn.Parameter] | None) -> list[nn.Parameter]:
    return [param] if param_list is None else list(param_list)


def _gather(params: list[nn.Parameter], what: str) -> None:
    fresh = [p for p in params if not state_of(p).api_held]
    if not fresh:
        return
    standalone = {id(p) for p in hold_gathered(fresh, what)}
    for p in fresh:
        state_of(p).api_held = True
        state_of(p).api_standalone = id(p) in standalone


def all_gather(
    self: nn.Parameter, param_list: Iterable[nn.Parameter] | None = None, async_op: bool = False, hierarchy: Any = None
) -> GatheredHandle | None:
    """Gather `param_list` (default: this parameter) and hold the full values until `partition()`.

    `hierarchy` (DeepSpeed's hpZ level) is accepted and has no effect: hpZ gathers from the secondary
    slice by itself. Returns a completed handle with `async_op`, else None.
    """
    del hierarchy
    _gather(_params(self, param_list), "param.all_gather")
    return GatheredHandle() if async_op else None


def all_gather_coalesced(
    self: nn.Parameter, params: Iterable[nn.Parameter], safe_mode: bool = False, quantize: bool = False
) -> GatheredHandle:
    """Gather `params` in one coalesced collective and hold them until `partition()`; returns a handle.

    `safe_mode` (DeepSpeed's cross-rank consistency check) is always on here: every gather is preceded by a
    fingerprint check (`_params.gather`). `quantize` (ZeRO++ qwZ) is refused: ds gathers exact values.
    """
    del safe_mode
    if quantize:
        raise NotImplementedError(
            "all_gather_coalesced(quantize=True): ds has no quantized weight gather (ZeRO++ qwZ); "
            "gather with quantize=False"
        )
    _gather(list(params), "param.all_gather_coalesced")
    return GatheredHandle()


def partition(
    self: nn.Parameter,
    param_list: Iterable[nn.Parameter] | None = None,
    hierarchy: Any = None,
    has_been_updated: bool = False,
    free_data: bool = True,
) -> None:
    """Release what `all_gather` held (default: this parameter); `has_been_updated` first stores the full
    values into the shards. Parameters something else still uses (a running forward, a `GatheredParameters`
    block) stay gathered until that lets go. `hierarchy` and `free_data` are DeepSpeed's and change
    nothing here (a released parameter's full storage is always freed)."""
    del hierarchy, free_data
    params = _params(self, param_list)
    if has_been_updated:
        for p in params:
            state_of(p).write_shard_from_full(state_of(p).full)
    held = [p for p in params if state_of(p).api_held]
    standalone = [p for p in held if state_of(p).api_standalone]
    for p in held:
        state_of(p).api_held = state_of(p).api_standalone = False
    if held:
        release_held(held, standalone)


def ds_summary(self: nn.Parameter, use_debug_name: bool = False) -> dict[str, Any]:
    """DeepSpeed's one-line description of a partitioned parameter (assertion messages print it).

    `use_debug_name` names the parameter by ds's state name (its module path once known) instead of `ds_id`.
    `shape` is the logical shape: ds keeps it while released, where DeepSpeed's is `(0,)`.
    """
    grad = self.grad
    shard = self.ds_tensor
    return {
        "id": state_of(self).name if use_debug_name else self.ds_id,
        "status": self.ds_status.name,
        "numel": self.numel(),
        "ds_numel": self.ds_numel,
        "shape": tuple(self.shape),
        "ds_shape": tuple(self.ds_shape),
        "requires_grad": self.requires_grad,
        "grad_shape": tuple(grad.shape) if grad is not None else None,
        "persist": self.ds_persist,
        "active_sub_modules": set(self.ds_active_sub_modules),  # a plain set: the summary pickles
        "ds_tensor.shape": shard.shape if shard is not None else None,
    }


def partition_numel(self: nn.Parameter) -> int:
    """The number of elements of this rank's shard, padding included (DeepSpeed's `ds_tensor.ds_numel`)."""
    return int(state_of(self).shard_numel)


def bind_param_methods(param: nn.Parameter) -> None:
    """Give a newly partitioned parameter DeepSpeed's per-parameter methods."""
    param.ds_summary = types.MethodType(ds_summary, param)
    param.all_gather = types.MethodType(all_gather, param)
    param.all_gather_coalesced = types.MethodType(all_gather_coalesced, param)
    param.partition = types.MethodType(partition, param)
    param.partition_numel = types.MethodType(partition_numel, param)
