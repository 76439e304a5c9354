"""`engine.offload_states()` / `reload_states()`: park the training states in host memory between steps (RLHF).

Under ZeRO the optimizer does it (`ds_zero`'s `offload_states`); at stage 0, which DeepSpeed does not
support, the engine names its own steppers' tensors to the same `ds_ops.StateOffloader`:

* `optim_states`: the base optimizer's state; `hp_params`: the fp32 masters (fp16/bf16 only: in fp32 the
  parameters are the masters); `lp_params`: the optimizer's parameters;
* `lp_grads`: gradients autograd is accumulating between boundaries; `contiguous_grad_buffer`: the flat
  gradient buffers, dropped (not copied) while no `.grad` points into them, since the next boundary
  overwrites them.

While anything is offloaded, `forward`, `backward`, `step` and `save_checkpoint` raise
`StatesOffloadedError` for the states they need rather than reading freed memory.
"""

from __future__ import annotations

from collections.abc import Container
from typing import Any

import torch

from ds_engine._step.precision import MixedPrecisionOptimizer
from ds_engine._step.steppers import Fp32Stepper, ZeroStepper
from ds_ops import OffloadDeviceEnum, OffloadStateTypeEnum, StateOffloader

__all__ = ["BACKWARD_NEEDS", "FORWARD_NEEDS", "SAVE_NEEDS", "STEP_NEEDS", "EngineOffloadStates"]

_Kind = OffloadStateTypeEnum
FORWARD_NEEDS = (_Kind.lp_params,)
BACKWARD_NEEDS = (_Kind.lp_params, _Kind.lp_grads, _Kind.contiguous_grad_buffer)
STEP_NEEDS = tuple(OffloadStateTypeEnum)
SAVE_NEEDS = (_Kind.optim_states, _Kind.hp_params, _Kind.lp_params)


def _optimizer_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def _unbound(buffer: Any) -> list[torch.Tensor]:
    """The buffer's flat tensor when no parameter's `.grad` is one of its views (its contents are dead)."""
    bound = any(p.grad is v for p, v in zip(buffer.params, buffer.views, strict=True))
    return [] if bound else [buffer.flat]


def stage0_states(stepper: Any) -> tuple[dict[OffloadStateTypeEnum, list[torch.Tensor]], list[torch.Tensor]]:
    """(tensors per kind of state, scratch gradient buffers) of a stage-0 stepper."""
    if isinstance(stepper, MixedPrecisionOptimizer):
        buffers = [stepper.master_grads] + ([stepper.accum] if stepper.accum is not stepper.master_grads else [])
        params = stepper.model_params
        masters = stepper.masters
    elif isinstance(stepper, Fp32Stepper):
        buffers = [stepper.buffer]
        params = [p for g in stepper.optimizer.param_groups for p in g["params"]]
        masters = []
    else:
        raise TypeError(f"offload_states: no state layout for {type(stepper).__name__}")
    flats = {b.flat.untyped_storage()._cdata for b in buffers}
    grads = [g for p in (*params, *masters) if (g := p.grad) is not None and g.untyped_storage()._cdata not in flats]
    states = {
        _Kind.optim_states: _optimizer_state(stepper.optimizer),
        _Kind.hp_params: list(masters),
        _Kind.lp_params: list(params),
        _Kind.lp_grads: grads,
        _Kind.contiguous_grad_buffer: [b.flat for b in buffers],
    }
    return states, [t for b in buffers for t in _unbound(b)]


class EngineOffloadStates:
    """Mixed into `DeepSpeedEngine`: DeepSpeed's `offload_states`, `reload_states`, `empty_partition_cache`."""

    _stepper: Any
    optimizer: Any
    _states_offloaded: bool = False
    _stage0_offloader: StateOffloader | None = None

    def offload_states(
        self,
        include: Container[OffloadStateTypeEnum] | None = None,
        device: OffloadDeviceEnum = OffloadDeviceEnum.cpu,
        pin_memory: bool = True,
        non_blocking: bool = False,
    ) -> None:
        """Move the training states (default: all kinds) to host memory until `reload_states()`.

        Each rank moves its own states (no collective). On a host whose accelerator is the CPU the
        states are already in host memory: only dead gradient memory is released (see
        `ds_ops.offload_states`). With ZeRO the optimizer does the work; parameter offload is refused.

        Moved memory is freed where it was, so a tensor taken from it before the call (a parameter's
        `.data`, a ZeRO shard, an optimizer state) must not be read until `reload_states()` gives it
        its bytes back; the parameters themselves read as NaN placeholders meanwhile. At ZeRO-3 a tensor
        taken inside `GatheredParameters` (`p.data.cpu()`) is the caller's once the block released the
        parameter, and is not moved.

        Args:
            include: kinds of state (`OffloadStateTypeEnum` members or names; None: all).
            device: `OffloadDeviceEnum.cpu`; `none` does nothing; `nvme` is an error, as in DeepSpeed.
            pin_memory: page-lock the host copies (where CUDA is available).
            non_blocking: do not wait for the copies.

        Raises:
            RuntimeError: the engine has no optimizer.
            ValueError: bad `device` or `include`, or ZeRO parameter offload is on.
        """
        stepper = self._require_stepper("offload_states()")
        if isinstance(stepper, ZeroStepper):
            stepper.optimizer.offload_states(
                include=include, device=device, pin_memory=pin_memory, non_blocking=non_blocking
            )
            self._states_offloaded = bool(stepper.optimizer.offloaded_states)
            return
        if self._stage0_offloader is None:
            self._stage0_offloader = StateOffloader()
        states, scratch = stage0_states(stepper)
        params = [p for g in stepper.optimizer.param_groups for p in g["params"]]
        if isinstance(stepper, MixedPrecisionOptimizer):
            params = [*stepper.model_params, *params]
        self._stage0_offloader.offload(
            states,
            params=params,
            scratch=scratch,
            include=include,  # type: ignore[arg-type]
            device=device,
            pin_memory=pin_memory,
            non_blocking=non_blocking,
        )
        self._states_offloaded = bool(self._stage0_offloader.offloaded)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring back, bit for bit, everything `offload_states()` moved; training then continues as before."""
        stepper = self._require_stepper("reload_states()")
        if isinstance(stepper, ZeroStepper):
            stepper.optimizer.reload_states(non_blocking=non_blocking)
        elif self._stage0_offloader is not None:
            self._stage0_offloader.reload(non_blocking=non_blocking)
        self._states_offloaded = False

    def state_devices(self, state: OffloadStateTypeEnum | str) -> set[torch.device]:
        """The devices the bytes of one kind of state are on now (DeepSpeed's `get_state_devices`).

        A state `offload_states()` moved counts on the device of its copy; gradient memory it released as
        dead (it comes back zero-filled) and a state that holds nothing count nowhere (an empty set).

        Raises:
            RuntimeError: the engine has no optimizer.
            ValueError: `state` is not an `OffloadStateTypeEnum` name.
        """
        stepper = self._require_stepper("state_devices()")
        if isinstance(stepper, ZeroStepper):
            return stepper.optimizer.state_devices(state)
        offloader = self._stage0_offloader if self._stage0_offloader is not None else StateOffloader()
        return offloader.state_devices(stage0_states(stepper)[0], state)

    def _offloaded_kinds(self) -> set[OffloadStateTypeEnum]:
        if isinstance(self._stepper, ZeroStepper):
            return set(self._stepper.optimizer.offloaded_states)
        return set(self._stage0_offloader.offloaded) if self._stage0_offloader is not None else set()

    def _check_states_loaded(self, call: str, needs: tuple[OffloadStateTypeEnum, ...]) -> None:
        """Raise `StatesOffloadedError` when `call` needs an offloaded state (cheap when nothing is)."""
        if self._states_offloaded:
            checker = StateOffloader()
            checker.offloaded = self._offloaded_kinds()
            checker.check_loaded(call, needs)

    def empty_partition_cache(self) -> None:
        """ZeRO-3: free the gathered parameters no running module holds; otherwise nothing (as DeepSpeed)."""
        stepper = self._stepper
        opt = stepper.optimizer if isinstance(stepper, ZeroStepper) else None
        release = getattr(opt, "empty_partition_cache", None)
        if release is not None:
            release()
        elif getattr(self, "parameter_offload", None) is not None:
            self.parameter_offload.release_all()  # type: ignore[attr-defined]

    def _require_stepper(self, call: str) -> Any:
        if self._stepper is None:
            raise RuntimeError(
                f"engine.{call} needs an optimizer (the states it moves are the optimizer's); this engine "
                "was built without one"
            )
        return self._stepper
