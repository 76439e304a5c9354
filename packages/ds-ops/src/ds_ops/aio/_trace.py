"""`IoTrace`: record every settled aio request (operation, bytes, when a worker started and finished it).

Made for benchmarks that ask where a ZeRO-Infinity step's time goes: the start and end stamps are
`time.monotonic_ns()` values taken by the op's worker threads, so they can be laid against phases the
caller times with the same clock (forward, backward, optimizer) to measure how much I/O overlapped
compute. Recording costs one small object per request and happens only while a trace is active.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from types import TracebackType

    from ds_ops.aio._requests import PendingRequest

__all__ = ["IoRecord", "IoTrace"]


@dataclass(frozen=True)
class IoRecord:
    """One settled request: "read" or "write", bytes moved, and its worker-side start and end."""

    op: str
    nbytes: int
    start_ns: int
    end_ns: int
    path: str


@dataclass
class IoTrace:
    """Context manager: while entered, every request any `AsyncIOHandle` of this process settles is recorded."""

    records: list[IoRecord] = field(default_factory=list)

    def __enter__(self) -> IoTrace:
        _ACTIVE.append(self)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        _ACTIVE.remove(self)

    def take(self) -> list[IoRecord]:
        """The records so far, which are then cleared (for per-step accounting)."""
        taken, self.records = self.records, []
        return taken


_ACTIVE: list[IoTrace] = []


def record_settled(requests: Iterable[PendingRequest]) -> None:
    """Called by `AsyncIOHandle.wait()` with the requests that just settled."""
    if not _ACTIVE:
        return
    rows = [
        IoRecord(r.op, int(r.result.bytes_done), int(r.result.start_ns), int(r.result.end_ns), r.path) for r in requests
    ]
    for trace in _ACTIVE:
        trace.records.extend(rows)
