"""`offload_states` / `reload_states` on the ZeRO optimizers: which tensors hold which state, at each stage.

The moving itself is `ds_ops.StateOffloader` (storages parked on the host and restored bit for bit;
see its notes for what happens on a CPU host). This module only names the tensors:

=========================  ====================================  =========================================
state                      stages 1 and 2                        stage 3
=========================  ====================================  =========================================
`optim_states`             the base optimizer's state tensors    the same
`hp_params`                the fp32 master partitions            the fp32 master partitions
`lp_params`                the flat model-dtype buffers          this rank's shards (+ persistent params)
`lp_grads`                 the fp32 gradient partitions          the masters' gradient partitions
`contiguous_grad_buffer`   stage-1 flat gradients, staging       nothing between steps
=========================  ====================================  =========================================

With optimizer offload the masters and the optimizer state already live on the host and are left
there, as DeepSpeed excludes them. Parameter offload (stage 3) is refused, as in DeepSpeed.
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from typing import Any

import torch

from ds_ops import OffloadDeviceEnum, OffloadStateTypeEnum, StateOffloader
from ds_zero._params.partitioned_param import ZeroParamStatus, state_of

__all__ = ["OffloadStatesMixin", "state_tensors"]

_Kind = OffloadStateTypeEnum


def _optimizer_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def _stage12(opt: Any) -> dict[OffloadStateTypeEnum, list[torch.Tensor]]:
    return {
        _Kind.optim_states: _optimizer_state(opt.optimizer),
        _Kind.hp_params: list(opt.masters),
        _Kind.lp_params: [f.flat for f in opt.flats],
        _Kind.lp_grads: list(opt.grad_partitions),
        _Kind.contiguous_grad_buffer: opt._grads.gradient_tensors(),
    }


def _stage3(opt: Any) -> dict[OffloadStateTypeEnum, list[torch.Tensor]]:
    params = opt.coordinator.params
    shards = [p.ds_tensor for p in params]
    whole = [state_of(p).full_flat for p in params if p.ds_status is ZeroParamStatus.AVAILABLE]
    masters = [part.master for part in opt.partitions if part.master is not None]
    return {
        _Kind.optim_states: _optimizer_state(opt.optimizer),
        _Kind.hp_params: masters,
        _Kind.lp_params: shards + whole,
        _Kind.lp_grads: [m.grad for m in masters if m.grad is not None],
        _Kind.contiguous_grad_buffer: [],
    }


def state_tensors(opt: Any) -> dict[OffloadStateTypeEnum, list[torch.Tensor]]:
    """The tensors of each kind of state a ZeRO optimizer holds now."""
    return _stage3(opt) if opt.zero_stage == 3 else _stage12(opt)


class OffloadStatesMixin:
    """DeepSpeed's `offload_states` / `reload_states` / `offloaded_states` for the ZeRO optimizers."""

    zero_stage: int
    optimizer: torch.optim.Optimizer
    _state_offloader: StateOffloader | None = None

    @property
    def offloaded_states(self) -> set[OffloadStateTypeEnum]:
        """The kinds of state offloaded now."""
        return set(self._state_offloader.offloaded) if self._state_offloader is not None else set()

    def offload_states(
        self,
        include: Container[OffloadStateTypeEnum] | None = None,
        device: OffloadDeviceEnum = OffloadDeviceEnum.cpu,
        pin_memory: bool = True,
        non_blocking: bool = False,
    ) -> None:
        """Move the selected states (default: all) to host memory until `reload_states()`.

        Between the two, parameters whose memory was moved read as NaN placeholders, and `step`,
        `backward` and checkpoints must not run. Not a collective: each rank moves its own partition.
        Moved memory is freed where it was: a tensor taken from it before the call (a parameter's
        `.data`, a shard, an optimizer state) must not be read until `reload_states()` gives it its
        bytes back. At stage 3 a tensor taken inside `GatheredParameters` (`p.data.cpu()`) is the
        caller's once the block released the parameter, and is not moved.

        Args:
            include: the kinds of state to move (`OffloadStateTypeEnum` members or their names).
            device: "cpu" (the only target, as in DeepSpeed); "none" does nothing.
            pin_memory: page-lock the host copies (where CUDA is available).
            non_blocking: do not wait for the device-to-host copies.

        Raises:
            ValueError: parameter offload is on (stage 3), or `device`/`include` is invalid.
        """
        config = getattr(self, "config", None)
        if config is not None and config.offload_param_device != "none":
            raise ValueError(
                "offload_states() is not supported with zero_optimization.offload_param (the parameters "
                "already live off the device), as in DeepSpeed"
            )
        if self._state_offloader is None:
            self._state_offloader = StateOffloader()
        if self.zero_stage == 3:
            self.empty_partition_cache()
        kinds = _included(include, host_optimizer=self._optimizer_on_host(), stage=self.zero_stage)
        self._state_offloader.offload(
            state_tensors(self),
            params=self._offload_params(),
            include=kinds,
            device=device,
            pin_memory=pin_memory,
            non_blocking=non_blocking,
        )

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring back everything `offload_states()` moved, bit for bit (a no-op when nothing is offloaded)."""
        if self._state_offloader is not None:
            self._state_offloader.reload(non_blocking=non_blocking)

    def state_devices(self, state: OffloadStateTypeEnum | str) -> set[torch.device]:
        """The devices the bytes of one kind of state are on now (empty: none held, or dropped by offload).

        Raises:
            ValueError: `state` is not an `OffloadStateTypeEnum` name.
        """
        offloader = self._state_offloader if self._state_offloader is not None else StateOffloader()
        return offloader.state_devices(state_tensors(self), state)

    def empty_partition_cache(self) -> None:
        """Stage 3: free every gathered parameter no running module holds (DeepSpeed's name); else nothing."""
        if self.zero_stage == 3:
            self.parameter_offload.release_all()  # type: ignore[attr-defined]

    def _optimizer_on_host(self) -> bool:
        offload = getattr(self, "offload", None)
        if offload is None:
            offload = getattr(self, "offload_optimizer", False)
        return bool(offload)

    def _offload_params(self) -> Iterable[torch.nn.Parameter]:
        if self.zero_stage == 3:
            return list(self.coordinator.params)  # type: ignore[attr-defined]
        return [p for flat in self.flats for p in flat.params]  # type: ignore[attr-defined]


def _included(
    include: Container[OffloadStateTypeEnum] | None, *, host_optimizer: bool, stage: int
) -> list[OffloadStateTypeEnum]:
    kinds = list(OffloadStateTypeEnum)
    if include is not None:
        try:
            kinds = [OffloadStateTypeEnum(k) for k in include]  # type: ignore[attr-defined]
        except ValueError as err:
            valid = ", ".join(k.value for k in OffloadStateTypeEnum)
            raise ValueError(f"offload_states: include has an unknown state ({err}); valid: {valid}") from None
    if host_optimizer:  # already on the host (DeepSpeed drops these too)
        skip = {_Kind.hp_params, _Kind.optim_states}
        if stage == 3:
            skip.add(_Kind.lp_grads)
        kinds = [k for k in kinds if k not in skip]
    return kinds
