"""Partitioning a built module, and keeping `to()`, `state_dict()` and `load_state_dict()` right afterwards.

Each module that owns partitioned parameters gets three small adjustments:

* `_apply` (behind `.to()`, `.half()`, `.cuda()`, ...) converts each shard and recreates the full storage
  in the new dtype/device, instead of reading the released values;
* a state_dict post-hook replaces each *released* parameter by an empty tensor (DeepSpeed's stage-3
  layout: a checkpoint never holds a placeholder that would load as NaN); gathered parameters (inside
  `GatheredParameters`) keep their values, and `state_dict(keep_vars=True)` keeps the parameter objects;
* load_state_dict pre/post hooks give each released parameter its full storage just for the copy, then
  keep this rank's slice and release it, so a full state_dict loads one module at a time. An *empty*
  tensor for a partitioned parameter (what a stage-3 `state_dict()` holds) means "the values live in the
  ZeRO partitions": the parameter is left as it is and not reported missing.
"""

from __future__ import annotations

import logging
import types
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

import ds_comm
from ds_zero._params.param_dict import install_param_dict
from ds_zero._params.partitioned_param import (
    ZeroParamStatus,
    is_zero_param,
    shard_numel,
    state_of,
)
from ds_zero._params.partitioning import partition_param
from ds_zero._params.placement import placement_group

logger = logging.getLogger(__name__)

__all__ = ["partition_module", "patch_module", "remove_guard"]


def partition_module(
    module: nn.Module,
    *,
    group: ProcessGroup | None,
    shard_device: torch.device | None = None,
    compute_device: torch.device | None = None,
    dtype: torch.dtype | None = None,
    pin_memory: bool = False,
    recurse: bool = True,
) -> int:
    """Partition every not-yet-partitioned parameter of `module` in place; returns how many were partitioned.

    Args:
        module: the module; its parameters must hold their full, initialised values.
        group: the data-parallel group (None: the world); a parameter of a placement family (AutoEP
            experts, `ds_zero._params.placement`) is split over its family's group instead.
        shard_device: where shards live ("cpu" for parameter offload; None: the compute device).
        compute_device: where full values are gathered (None: where each parameter is).
        dtype: cast floating-point parameters to it (None keeps theirs).
        pin_memory: page-lock CPU shards.
        recurse: include submodules.
    """
    modules = list(module.modules()) if recurse else [module]
    todo: list[nn.Parameter] = []
    seen: set[int] = set()
    for m in modules:
        for p in m._parameters.values():
            if p is not None and not is_zero_param(p) and p.numel() and id(p) not in seen:
                seen.add(id(p))
                todo.append(p)
    groups = [placement_group(p, group) for p in todo]
    buffers = _shared_shard_buffers(todo, groups, shard_device, compute_device, dtype, pin_memory)
    for p, out, p_group in zip(todo, buffers, groups, strict=True):
        partition_param(
            p,
            group=p_group,
            shard_device=shard_device,
            compute_device=compute_device,
            dtype=dtype,
            pin_memory=pin_memory,
            out=out,
        )
    for m in modules:
        if any(is_zero_param(p) for p in m._parameters.values()):
            patch_module(m)
    return len(todo)


def _shared_shard_buffers(
    params: list[nn.Parameter],
    groups: list[ProcessGroup | None],
    shard_device: torch.device | None,
    compute_device: torch.device | None,
    dtype: torch.dtype | None,
    pin_memory: bool,
) -> list[torch.Tensor | None]:
    """Slices of one flat buffer for all the shards when they share dtype and device (else Nones).

    One buffer per model, in parameter order, is also the layout the optimizer's flat partition wants,
    which then needs no copy; and many small shard allocations would fragment the host heap.
    """
    kinds = set()
    for p in params:
        target = dtype if (dtype is not None and p.is_floating_point()) else p.dtype
        device = shard_device or compute_device or p.device
        kinds.add((target, torch.device(device)))
    if len(kinds) != 1 or len(params) < 2:
        return [None] * len(params)
    target, device = kinds.pop()
    sizes = [shard_numel(p.numel(), ds_comm.get_world_size(g)) for p, g in zip(params, groups, strict=True)]
    flat = torch.empty(sum(sizes), dtype=target, device=device)
    if pin_memory and device.type == "cpu":
        flat = ds_comm.get_accelerator().pin_memory(flat)
    return list(torch.split(flat, sizes))


def patch_module(module: nn.Module) -> None:
    """Install the `_apply` override and the state_dict/load hooks once on a module owning partitioned params."""
    if getattr(module, "_ds_zero_patched", False):
        return
    install_param_dict(module)
    module._ds_guard = module.register_forward_pre_hook(_unmanaged_guard)
    module._apply = types.MethodType(_zero_apply, module)
    module.register_state_dict_post_hook(_state_dict_post_hook)
    module.register_load_state_dict_pre_hook(_load_pre_hook)
    module.register_load_state_dict_post_hook(_load_post_hook)
    module._ds_zero_patched = True


def _zero_apply(self: nn.Module, fn: Any, recurse: bool = True) -> nn.Module:
    zero = {k: p for k, p in self._parameters.items() if is_zero_param(p)}
    if not zero:
        return type(self)._apply(self, fn, recurse)
    saved = self._parameters
    rest = {k: p for k, p in saved.items() if k not in zero}
    self._parameters = rest
    try:
        type(self)._apply(self, fn, recurse)
    finally:
        for k, p in rest.items():
            saved[k] = p
        self._parameters = saved
    for p in zero.values():
        st = state_of(p)
        if _is_noop(fn, st.full) and _is_noop(fn, p.ds_tensor):
            continue
        if st.master_sink is not None:
            raise ValueError(
                f"cannot convert partitioned parameter {st.name} ({st.full.dtype} on "
                f"{st.full.device}) after its ZeRO stage-3 optimizer was built; call .to()/.half() "
                "on the model before building DeepSpeedZeroOptimizer_Stage3"
            )
        old_key = st.full_flat.untyped_storage()._cdata
        state_of(p).convert(fn)
        coord = st.coord
        if coord is not None:
            coord.storage_replaced(old_key, p)
    return self


def _unmanaged_guard(module: nn.Module, args: Any) -> None:
    """Refuse a forward over released parameters that no stage-3 coordinator will gather (it would give NaN)."""
    for name, p in module._parameters.items():
        if is_zero_param(p) and state_of(p).coord is None and p.ds_status is not ZeroParamStatus.AVAILABLE:
            raise RuntimeError(
                f"{type(module).__name__}.{name} is partitioned (ds_zero.Init / partition_model) but nothing gathers "
                "it for this forward: wrap the model first (ds_zero.DeepSpeedZeroOptimizer_Stage3, "
                "ds_zero.DeepSpeedZeRoOffload for evaluation, or ds_engine.initialize), or run the forward inside "
                "ds_zero.GatheredParameters(model.parameters())"
            )


def remove_guard(module: nn.Module) -> None:
    """A coordinator took the module over: drop the unmanaged-forward guard."""
    handle = module.__dict__.pop("_ds_guard", None)
    if handle is not None:
        handle.remove()


def _is_noop(fn: Any, t: torch.Tensor) -> bool:
    probe = fn(torch.empty(0, dtype=t.dtype, device=t.device))
    return probe.dtype == t.dtype and probe.device == t.device


def _state_dict_post_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    for name, p in module._parameters.items():
        if not is_zero_param(p) or p.ds_status is ZeroParamStatus.AVAILABLE:
            continue
        key = prefix + name
        value = state_dict.get(key)
        if value is not None and value is not p:
            state_dict[key] = torch.empty(0, dtype=p.dtype, device=p.device)


def _load_pre_hook(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    loading = []
    skipped = []
    for name, p in module._parameters.items():
        key = prefix + name
        if not is_zero_param(p) or key not in state_dict:
            continue
        value = state_dict[key]
        if isinstance(value, torch.Tensor) and value.numel() == 0 and p.ds_numel > 0:
            del state_dict[key]
            skipped.append(key)
            continue
        was_available = p.ds_status is ZeroParamStatus.AVAILABLE
        if not was_available:
            state_of(p).materialize()
        loading.append((p, was_available))
    module._ds_loading = loading
    module._ds_load_skipped = skipped


def _load_post_hook(module: nn.Module, incompatible_keys: Any) -> None:
    skipped = getattr(module, "_ds_load_skipped", None)
    if skipped:
        missing = incompatible_keys.missing_keys
        missing[:] = [k for k in missing if k not in skipped]
        module._ds_load_skipped = []
    loading = getattr(module, "_ds_loading", None)
    if not loading:
        return
    module._ds_loading = []
    for p, was_available in loading:
        state_of(p).write_shard_from_full(state_of(p).full)
        if not was_available:
            state_of(p).release()
