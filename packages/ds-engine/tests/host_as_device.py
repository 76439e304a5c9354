"""An accelerator that treats host memory as a device with streams, so offload paths run on CPU.

The CPU accelerator is synchronous, so offload code rightly leaves CPU tensors alone there.
`HostAsDevice` claims to be asynchronous and hands out `HostStream`s whose events finish
only when told to (or at `synchronize()`), which lets a test drive the copy, stash and
buffer-pool logic that a CUDA device would run, and watch which buffers were pinned.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ds_comm.accelerator import CpuAccelerator


class HostEvent:
    """A recorded point on a `HostStream`; done at once unless its stream holds its events."""

    def __init__(self, stream: HostStream) -> None:
        self.stream = stream
        self.done = not stream.hold_events

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


class HostStream:
    """Records what was asked of it; work itself runs eagerly on the host."""

    def __init__(self, name: str = "side") -> None:
        self.name = name
        self.hold_events = False
        self.events: list[HostEvent] = []
        self.waited_streams: list[HostStream] = []
        self.waited_events: list[HostEvent] = []

    def wait_stream(self, other: HostStream) -> None:
        self.waited_streams.append(other)

    def record_event(self) -> HostEvent:
        event = HostEvent(self)
        self.events.append(event)
        return event

    def wait_event(self, event: HostEvent) -> None:
        self.waited_events.append(event)

    def synchronize(self) -> None:
        for event in self.events:
            event.done = True

    def __repr__(self) -> str:
        return f"HostStream({self.name})"


class HostAsDevice(CpuAccelerator):
    """The host as an asynchronous device: CPU tensors count as "on the accelerator"."""

    def __init__(self) -> None:
        super().__init__()
        self.compute = HostStream("compute")
        self.side_streams: list[HostStream] = []
        self.active: list[HostStream] = []
        self.pinned: list[torch.Tensor] = []

    def is_synchronized_device(self) -> bool:
        return False

    @property
    def Stream(self) -> type:  # noqa: N802 - DeepSpeed's name
        accel = self

        class _Side(HostStream):
            def __init__(self) -> None:
                super().__init__("side")
                accel.side_streams.append(self)

        return _Side

    def current_stream(self, device_index: int | None = None) -> HostStream:
        return self.active[-1] if self.active else self.compute

    @contextlib.contextmanager
    def stream(self, stream: HostStream) -> Iterator[None]:
        self.active.append(stream)
        try:
            yield
        finally:
            self.active.pop()

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        self.pinned.append(tensor)
        return tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return any(tensor is p for p in self.pinned)
