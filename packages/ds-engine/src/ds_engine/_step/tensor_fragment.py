"""`deepspeed.utils.tensor_fragment`: DeepSpeed's per-parameter accessors of ZeRO's partitioned state.

`safe_get_full_fp32_param(p)`, `safe_get_full_grad(p)`, `safe_get_full_optimizer_state(p, key)` and their
`safe_set_full_*` counterparts read or write one parameter's whole fp32 master value, averaged gradient
or optimizer state (`exp_avg`...), assembled from the ranks' partitions: a collective over the
data-parallel group at every ZeRO stage, so every rank calls them for the same parameters in the same
order, and setters take the same whole value on every rank. `safe_get_local_*` / `safe_set_local_*`
touch this rank's partition only (no communication) and exist for ZeRO-3 partitioned parameters only.
`safe_update_full_grad_vectorized(params, fn)` sets each gradient to `fn(gradient, param)`.

Semantics are DeepSpeed 0.19.8's: gradients are the current accumulation's, between backward and the
step (scaled by the loss scale with fp16), in fp32. At stages 1 and 2 asking outside that window is a
ValueError, at stage 3 it gives zeros. A frozen parameter, or one no ZeRO optimizer trains, gives None
(setters leave it alone). Without ZeRO (stage 0) there is no partitioned fp32 state: the fp32 getters
give None, setters do nothing, and `safe_get_full_grad` is this rank's own gradient (ds's stage 0
all-reduces gradients inside `step()`): `param.grad`, or with fp16/bf16 the fp32 accumulation buffer the
16-bit gradients were moved into.

The work is ds-zero's: each ZeRO optimizer implements DeepSpeed's stage-3 optimizer methods
(`get_full_hp_param`, `get_fp32_grad_for_param`, ...; the `ZeroParamAccess` contract) and
`ds_zero.zero_optimizer_of(param)` finds the one that trains a parameter. This module only dispatches,
and needs ds-zero only when a ZeRO optimizer exists (so never imports it itself).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ds_engine._step.precision import stage0_grad_owner
from ds_engine._step.zero_contract import ZeroParamAccess

__all__ = [
    "fragment_address",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "safe_update_full_grad_vectorized",
]


@dataclass
class fragment_address:  # noqa: N801 - DeepSpeed's class name, pickled under it in ZeRO-1/2 checkpoints
    """Where one parameter's slice starts in a flat partition and how many elements it has.

    DeepSpeed's ZeRO-1/2 optimizer-state files pickle these (`param_slice_mappings`), so with `deepspeed`
    imported, `torch.load(..., weights_only=False)` of such a file looks the class up at this path.
    """

    numel: int
    start: int


def _owner(param: torch.Tensor) -> ZeroParamAccess | None:
    """The ZeRO optimizer training `param`, if any. ds-zero not imported means no ZeRO optimizer was built."""
    ds_zero = sys.modules.get("ds_zero")
    if ds_zero is None or not isinstance(param, torch.Tensor):
        return None
    owner: ZeroParamAccess | None = ds_zero.zero_optimizer_of(param)
    return owner


def _zero3_owner(param: torch.Tensor, what: str) -> ZeroParamAccess | None:
    if not hasattr(param, "ds_id"):
        shape = tuple(param.shape) if isinstance(param, torch.Tensor) else type(param).__name__
        raise ValueError(
            f"{what} is defined for ZeRO-3 partitioned parameters only; this parameter ({shape}) is not "
            "partitioned (ZeRO stage 0-2, or not under stage-3 management): use the safe_get_full_* functions"
        )
    return _owner(param)


# -------------------------------------------------------------------------------- whole values (collectives)
def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """The whole fp32 master value of `param` (a new tensor); None without ZeRO or for an untrained parameter."""
    owner = _owner(param)
    return None if owner is None else owner.get_full_hp_param(param)


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set `param`'s fp32 master to the whole `value`; the model's weights take it at the next step."""
    owner = _owner(param)
    if owner is not None:
        owner.set_full_hp_param(value, param)


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """The whole fp32 optimizer state `optim_state_key` (`"exp_avg"`, `"exp_avg_sq"`...) of `param`."""
    owner = _owner(param)
    return None if owner is None else owner.get_full_hp_param(param, optim_state_key)


def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """Set `param`'s optimizer state `optim_state_key` to the whole `value`."""
    owner = _owner(param)
    if owner is not None:
        owner.set_full_hp_param(value, param, optim_state_key)


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The whole averaged gradient of `param` in fp32, between backward and step (stage 0: `param.grad`)."""
    owner = _owner(param)
    if owner is not None:
        return owner.get_fp32_grad_for_param(param)
    mixed = stage0_grad_owner(param)
    if mixed is not None:  # fp16/bf16 at stage 0: the gradient may already sit in the fp32 accumulation buffer
        return mixed.fp32_grad_of(param)
    return param.grad


def safe_set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Replace `param`'s whole averaged gradient by `value`, between backward and step."""
    owner = _owner(param)
    mixed = stage0_grad_owner(param) if owner is None else None
    if owner is not None:
        owner.set_fp32_grad_for_param(value, param)
    elif mixed is not None:
        mixed.set_fp32_grad_of(param, value)
    elif param.grad is not None:
        param.grad.copy_(value)


def safe_update_full_grad_vectorized(
    param_list: list[torch.Tensor], update_func: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> None:
    """For each parameter: gradient = `update_func(whole gradient, param)` (DeepSpeed's vectorized update)."""
    by_owner: dict[int, tuple[ZeroParamAccess, list[torch.Tensor]]] = {}
    for p in param_list:
        owner = _owner(p)
        mixed = stage0_grad_owner(p) if owner is None else None
        if owner is not None:
            by_owner.setdefault(id(owner), (owner, []))[1].append(p)
        elif mixed is not None:
            grad = mixed.fp32_grad_of(p)
            if grad is not None:
                mixed.set_fp32_grad_of(p, update_func(grad, p))
        elif p.grad is not None:
            p.grad.copy_(update_func(p.grad, p))
    for owner, params in by_owner.values():
        owner.update_fp32_grad_for_param_vectorized(update_func, params)


# ------------------------------------------------------------------------------- this rank's partition (ZeRO-3)
def safe_get_local_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's slice of `param`'s fp32 master (a view, `ceil(numel / world)` elements, zero-padded)."""
    owner = _zero3_owner(param, "safe_get_local_fp32_param")
    return None if owner is None else owner.get_local_fp32_param(param)


def safe_set_local_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set this rank's slice of `param`'s fp32 master."""
    owner = _zero3_owner(param, "safe_set_local_fp32_param")
    if owner is not None:
        owner.set_local_hp_param(value, param)


def safe_get_local_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """This rank's slice of `param`'s optimizer state `optim_state_key` (a view)."""
    owner = _zero3_owner(param, "safe_get_local_optimizer_state")
    return None if owner is None else owner.get_local_fp32_param(param, optim_state_key)


def safe_set_local_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """Set this rank's slice of `param`'s optimizer state `optim_state_key`."""
    owner = _zero3_owner(param, "safe_set_local_optimizer_state")
    if owner is not None:
        owner.set_local_hp_param(value, param, optim_state_key)


def safe_get_local_grad(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's slice of `param`'s averaged fp32 gradient (a view)."""
    owner = _zero3_owner(param, "safe_get_local_grad")
    return None if owner is None else owner.get_local_fp32_grad_for_param(param)


def safe_set_local_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set this rank's slice of `param`'s averaged gradient."""
    owner = _zero3_owner(param, "safe_set_local_grad")
    if owner is not None:
        owner.set_local_grad_for_param(value, param)
