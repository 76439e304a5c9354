"""`GatheredParameters`: full parameters inside a block; `register_external_parameter`."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from types import TracebackType
from typing import Any

import torch
from torch import nn

import ds_comm
from ds_zero._params.gather import broadcast_full, gather_params
from ds_zero._params.partitioned_param import (
    ZeroParamStatus,
    is_zero_param,
    iter_zero_params,
    state_of,
)

logger = logging.getLogger(__name__)

__all__ = [
    "GatheredParameters",
    "external_params",
    "hold_gathered",
    "register_external_parameter",
    "release_held",
    "unregister_external_parameter",
]


def _as_list(params: Any) -> list[Any]:
    if params is None:
        return []
    if isinstance(params, torch.Tensor):
        return [params]
    if isinstance(params, nn.Module):
        raise TypeError(
            "GatheredParameters takes parameters, not a module: pass module.parameters() "
            "(or module.parameters(recurse=False) for its own)"
        )
    if isinstance(params, Iterable):
        return list(params)
    raise TypeError(f"GatheredParameters takes a parameter or an iterable of parameters, got {type(params).__name__}")


class GatheredParameters:
    """Gather partitioned parameters for the duration of a `with` block (DeepSpeed's context manager).

    On entry the full values of `params` are all-gathered (one coalesced collective); inside the block
    they are ordinary full tensors. On exit, with `modifier_rank` set, that rank's values (changed in
    the block) are broadcast to every rank, and each rank keeps its slice in its shard (and in the
    optimizer's fp32 master, when there is one); without `modifier_rank`, changes are discarded. Then
    the parameters are released, unless something else (a running forward, an outer block) uses them.
    Non-partitioned parameters and non-parameters in `params` are ignored, as in DeepSpeed.

    Every rank of the parameters' group must enter and leave the block (collectives on entry, and on
    exit with `modifier_rank`). A block left with an exception skips the broadcast.

    Args:
        params: a parameter or an iterable of parameters (e.g. `model.parameters()`).
        modifier_rank: the rank (within the parameters' group) whose changes are kept; None keeps none.
        fwd_module: also register `params` as external parameters of this module, so its forward
            gathers them from now on.
        enabled: False makes the block a no-op.
    """

    def __init__(
        self, params: Any, modifier_rank: int | None = None, fwd_module: nn.Module | None = None, enabled: bool = True
    ) -> None:
        self.params = iter_zero_params(_as_list(params)) if enabled else []
        self.modifier_rank = modifier_rank
        self.fwd_module = fwd_module
        self.enabled = enabled
        self._standalone: list[nn.Parameter] = []
        if self.params and modifier_rank is not None:
            world = ds_comm.get_world_size(self.params[0].ds_process_group)
            if not 0 <= modifier_rank < world:
                raise ValueError(
                    f"modifier_rank={modifier_rank} is not a rank of the parameters' group "
                    f"(size {world}); pass a rank in [0, {world - 1}] or None"
                )

    def __enter__(self) -> GatheredParameters:
        if not self.params:
            return self
        self._standalone = hold_gathered(self.params, "GatheredParameters")
        if self.fwd_module is not None:
            for p in self.params:
                register_external_parameter(self.fwd_module, p)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self.params:
            return
        try:
            if exc_type is None and self.modifier_rank is not None:
                group = self.params[0].ds_process_group
                broadcast_full(self.params, self.modifier_rank, group)
                for p in self.params:
                    state_of(p).write_shard_from_full(state_of(p).full)
        finally:
            release_held(self.params, self._standalone)
            self._standalone = []


def hold_gathered(params: list[nn.Parameter], what: str) -> list[nn.Parameter]:
    """Gather `params` (partitioned parameters) and hold them until `release_held`.

    Parameters of a model under stage-3 management are claimed through their coordinator (so a running
    forward does not release them); the others ("standalone", e.g. built under `Init` and not yet in an
    engine) are gathered here if not available already.

    Returns:
        The standalone parameters this call gathered: `release_held` frees exactly those.
    """
    managed = [p for p in params if state_of(p).coord is not None]
    coords = {id(state_of(p).coord): state_of(p).coord for p in managed}
    for coord in coords.values():
        coord.gather_explicit(
            [p for p in managed if state_of(p).coord is coord],
            f"{what} ({len(managed)} parameters, first {state_of(managed[0]).name!r})",
        )
    standalone = [p for p in params if state_of(p).coord is None]
    missing = [p for p in standalone if p.ds_status is not ZeroParamStatus.AVAILABLE]
    if missing:
        group = missing[0].ds_process_group
        gather_params(
            missing,
            group=group,
            fp_group=group,
            label=f"{what} ({len(missing)} parameters of shapes {[tuple(p.ds_shape) for p in missing[:4]]})",
        )
    return missing


def release_held(params: list[nn.Parameter], standalone: list[nn.Parameter]) -> None:
    """Undo `hold_gathered(params)`: free the standalone parameters it gathered, release the claims of the
    managed ones (freed when nothing else uses them)."""
    for p in standalone:
        state_of(p).release()
    managed = [p for p in params if state_of(p).coord is not None]
    coords = {id(state_of(p).coord): state_of(p).coord for p in managed}
    for coord in coords.values():
        coord.release_explicit([p for p in managed if state_of(p).coord is coord])


def external_params(module: nn.Module) -> dict[int, nn.Parameter]:
    """`module._external_params`: the parameters registered on it that another module owns, by `id`.

    DeepSpeed's attribute (its tests and some user code read it); created empty on first use. Parameters
    gathered because a forward read them on its own are not listed (the coordinator's units hold those).
    """
    found = module.__dict__.get("_external_params")
    if not isinstance(found, dict):
        found = module.__dict__["_external_params"] = {}
    return found


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Gather `parameter` whenever `module` runs, although another module owns it (DeepSpeed's name).

    Not required for correctness here (a read of another module's parameter inside a forward gathers it
    and registers it automatically, and so does returning a parameter from a forward), but registering up
    front lets the first iteration coalesce it.
    """
    if not isinstance(parameter, nn.Parameter):
        raise TypeError(f"register_external_parameter takes an nn.Parameter, got {type(parameter).__name__}")
    external_params(module)[id(parameter)] = parameter
    coord = state_of(parameter).coord if is_zero_param(parameter) else None
    if coord is not None:
        coord.add_external(module, parameter)


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Undo `register_external_parameter`."""
    external_params(module).pop(id(parameter), None)
    coord = state_of(parameter).coord if is_zero_param(parameter) else None
    if coord is not None:
        coord.remove_external(module, parameter)
