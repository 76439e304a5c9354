"""Moving a training job's states off their device and back (DeepSpeed's `offload_states`/`reload_states`).

An RLHF loop alternates a trainer with a generator on the same accelerators: between training steps
the trainer parks its optimizer state, fp32 masters, 16-bit parameters and gradient buffers in host
memory so the generator can use the device, then brings them back bit for bit. ds-zero's optimizers
and ds-engine's stage-0 steppers each say which tensors hold which kind of state; `StateOffloader`
does the moving for all of them.

[Note: storages, not tensors] The states are full of aliases: parameters are views of a flat buffer,
an fp32 master can be that buffer itself, stage-3 tiles are views of the master, the base optimizer
keys its state by those views. Rebinding one tensor's `.data` (DeepSpeed's way) frees nothing while
another view holds the old storage, and leaves the views on stale memory after the reload. So the
unit moved here is the *storage*: its bytes are copied to a buffer on the target device and the
storage shrinks to 0 bytes (`untyped_storage().resize_(0)`, as ZeRO-3 releases a gathered
parameter); reloading grows the same storage and copies the bytes back. Every view, wherever it is
held, sees the restored values, and the device memory really is freed in between.

A tensor over a 0-byte storage must not be read (torch does not bounds-check it), so user-visible
handles are swapped out while their storage is parked: a parameter's `.data` becomes a NaN
placeholder of its shape (reading gives NaN, writing raises), and a `.grad` is set to None; both are
put back by `reload`. The owners' internal tensors are guarded by their owners (the engine refuses
`forward`/`backward`/`step` until `reload_states()`).

[Note: on a CPU host] The target is where the states already are, so there is nothing to move and
nothing is copied; what offloading still frees is gradient memory whose contents are dead: buffers
that hold only zeros (the accumulators after a step) or that the owner marks as scratch (a flat
buffer the next step overwrites). They are released and come back zero-filled. Off a CPU host the
same gradient buffers are dropped rather than copied, which saves the transfer.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Iterable, Mapping
from typing import ClassVar

import torch

logger = logging.getLogger(__name__)

__all__ = ["OffloadDeviceEnum", "OffloadStateTypeEnum", "StateOffloader", "StatesOffloadedError"]


class OffloadDeviceEnum(enum.StrEnum):
    """Where offloaded state goes (DeepSpeed's `deepspeed.runtime.zero.offload_config.OffloadDeviceEnum`)."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(enum.StrEnum):
    """The kinds of training state `offload_states(include=...)` selects (DeepSpeed's names)."""

    optim_states = "optim_states"
    """The base optimizer's state (Adam's moments, ...)."""
    hp_params = "hp_params"
    """fp32 master weights (the same memory as `lp_params` where the model trains in fp32)."""
    lp_params = "lp_params"
    """The model's parameters (ZeRO: the flat buffers / this rank's shards)."""
    lp_grads = "lp_grads"
    """Gradients (ZeRO: this rank's gradient partitions)."""
    contiguous_grad_buffer = "contiguous_grad_buffer"
    """Flat gradient buffers the gradients are reduced in."""


_GRADIENTS = frozenset({OffloadStateTypeEnum.lp_grads, OffloadStateTypeEnum.contiguous_grad_buffer})


class StatesOffloadedError(RuntimeError):
    """A call needs training states that `offload_states()` moved away; `reload_states()` first."""


@dataclasses.dataclass(eq=False)
class _Parked:
    storage: torch.UntypedStorage
    nbytes: int
    backup: torch.Tensor | None
    """The bytes on the target device; None: the contents were dead, refill with zeros."""


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """The whole storage as a flat uint8 tensor (a view, no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _placeholder(param: torch.Tensor) -> torch.Tensor:
    fill = float("nan") if param.dtype.is_floating_point or param.dtype.is_complex else 0
    return torch.full((1,), fill, dtype=param.dtype, device=param.device).expand(param.shape)


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class StateOffloader:
    """Parks the storages behind a job's states on another device and restores them (see the module notes).

    One instance per optimizer; it remembers what it parked until `reload`.
    """

    copy_on_same_device: ClassVar[bool] = False
    """Also copy states whose storage is already on the target device (frees nothing there: tests set it
    to run the device-to-host path on a CPU host)."""

    def __init__(self) -> None:
        self._parked: dict[int, _Parked] = {}
        self._params: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        self._grads: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        self.offloaded: set[OffloadStateTypeEnum] = set()

    @property
    def parked_bytes(self) -> int:
        """Bytes of the storages parked now (freed on their home device)."""
        return sum(p.nbytes for p in self._parked.values())

    def offload(
        self,
        states: Mapping[OffloadStateTypeEnum, Iterable[torch.Tensor]],
        *,
        params: Iterable[torch.nn.Parameter] = (),
        scratch: Iterable[torch.Tensor] = (),
        include: Iterable[OffloadStateTypeEnum | str] | None = None,
        device: OffloadDeviceEnum | str = OffloadDeviceEnum.cpu,
        pin_memory: bool = True,
        non_blocking: bool = False,
    ) -> None:
        """Park the storages of the selected states on `device` (a kind already offloaded is skipped).

        Args:
            states: the tensors of each kind of state (views are fine; each storage moves once).
            params: the user-visible parameters; those whose storage gets parked hold a placeholder
                until `reload`, and a `.grad` over a parked storage is set aside.
            scratch: gradient tensors whose contents the owner will overwrite before reading them.
            include: the kinds to offload (None: all).
            device: only "cpu" moves anything; "none" does nothing (as in DeepSpeed).
            pin_memory: page-lock the host copies (only where CUDA is available).
            non_blocking: do not wait for device copies to finish.

        Raises:
            ValueError: `device` is "nvme" or unknown, or `include` names an unknown kind.
        """
        target = _target_device(device)
        if target is None:
            logger.warning("offload_states: device 'none' given; nothing is offloaded")
            return
        kinds = _kinds(include)
        dead = {t.untyped_storage()._cdata for t in scratch}
        pin = pin_memory and target.type == "cpu" and torch.cuda.is_available()
        for kind in OffloadStateTypeEnum:  # a fixed order: a storage shared by two kinds moves once
            if kind not in kinds or kind in self.offloaded:
                continue
            for tensor in states.get(kind, ()):
                self._park(tensor, kind, target, pin, non_blocking, dead)
            self.offloaded.add(kind)
        self._swap_out_handles(params)
        if not non_blocking:
            _synchronize()

    def _park(
        self,
        tensor: torch.Tensor,
        kind: OffloadStateTypeEnum,
        target: torch.device,
        pin: bool,
        non_blocking: bool,
        dead: set[int],
    ) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        nbytes = storage.nbytes()
        if key in self._parked or nbytes == 0:
            return
        if not storage.resizable():  # a buffer over foreign memory (huge pages, a file): leave it
            logger.debug("offload_states: a %s storage of %d bytes is not resizable; it stays", kind.value, nbytes)
            return
        if kind in _GRADIENTS and (key in dead or not bool(_bytes_of(storage).any())):
            storage.resize_(0)
            self._parked[key] = _Parked(storage, nbytes, None)
            return
        if storage.device == target and not self.copy_on_same_device:
            return
        backup = torch.empty(nbytes, dtype=torch.uint8, device=target, pin_memory=pin)
        backup.copy_(_bytes_of(storage), non_blocking=non_blocking)
        storage.resize_(0)
        self._parked[key] = _Parked(storage, nbytes, backup)

    def _swap_out_handles(self, params: Iterable[torch.nn.Parameter]) -> None:
        for p in params:
            if p.data.untyped_storage()._cdata in self._parked:
                self._params.append((p, p.data))
                p.data = _placeholder(p)
            grad = p.grad
            if grad is not None and grad.untyped_storage()._cdata in self._parked:
                self._grads.append((p, grad))
                p.grad = None

    def reload(self, *, non_blocking: bool = False) -> None:
        """Grow every parked storage back on its own device and copy its bytes in (zeros for dead ones)."""
        for parked in self._parked.values():
            parked.storage.resize_(parked.nbytes)
            view = _bytes_of(parked.storage)
            if parked.backup is None:
                view.zero_()
            else:
                view.copy_(parked.backup, non_blocking=non_blocking)
        for param, data in self._params:
            param.data = data
        for p, grad in self._grads:
            if p.grad is None:
                p.grad = grad
        if not non_blocking:
            _synchronize()
        self._parked.clear()
        self._params.clear()
        self._grads.clear()
        self.offloaded.clear()

    def state_devices(
        self, states: Mapping[OffloadStateTypeEnum, Iterable[torch.Tensor]], state: OffloadStateTypeEnum | str
    ) -> set[torch.device]:
        """Where the bytes of one kind of state are now (DeepSpeed's `get_state_devices` reads this).

        Args:
            states: the tensors of each kind of state, as given to `offload`.
            state: the kind asked about (a member or its name).

        A parked storage counts on the device of its copy; one dropped as dead gradient memory (it comes
        back zero-filled) and an empty storage count nowhere; any other on the tensor's own device.

        Raises:
            ValueError: `state` is not an `OffloadStateTypeEnum` name.
        """
        try:
            kind = OffloadStateTypeEnum(state)
        except ValueError:
            valid = ", ".join(k.value for k in OffloadStateTypeEnum)
            raise ValueError(f"state_devices: unknown state {state!r}; valid: {valid}") from None
        devices: set[torch.device] = set()
        for tensor in states.get(kind, ()):
            storage = tensor.untyped_storage()
            parked = self._parked.get(storage._cdata)
            if parked is not None:
                if parked.backup is not None:
                    devices.add(parked.backup.device)
            elif storage.nbytes() > 0:
                devices.add(tensor.device)
        return devices

    def check_loaded(self, call: str, needs: Iterable[OffloadStateTypeEnum]) -> None:
        """Raise `StatesOffloadedError` naming `call` if any state it `needs` is offloaded."""
        missing = sorted(k.value for k in needs if k in self.offloaded)
        if missing:
            raise StatesOffloadedError(
                f"{call} needs the training states {', '.join(missing)}, which offload_states() moved off; "
                "call reload_states() first"
            )


def _target_device(device: OffloadDeviceEnum | str) -> torch.device | None:
    try:
        kind = OffloadDeviceEnum(device)
    except ValueError:
        raise ValueError(f"offload_states: device must be 'cpu' or 'none', got {device!r}") from None
    if kind is OffloadDeviceEnum.nvme:
        raise ValueError("offload_states: NVMe is not supported as a target (as in DeepSpeed); use device='cpu'")
    return None if kind is OffloadDeviceEnum.none else torch.device("cpu")


def _kinds(include: Iterable[OffloadStateTypeEnum | str] | None) -> set[OffloadStateTypeEnum]:
    if include is None:
        return set(OffloadStateTypeEnum)
    kinds = set()
    for item in include:
        try:
            kinds.add(OffloadStateTypeEnum(item))
        except ValueError:
            valid = ", ".join(k.value for k in OffloadStateTypeEnum)
            raise ValueError(f"offload_states: include has unknown state {item!r}; valid: {valid}") from None
    return kinds
