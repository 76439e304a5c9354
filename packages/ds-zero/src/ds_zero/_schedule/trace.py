"""The execution order of gather units, recorded on the first iteration and replayed for prefetch and reuse.

An iteration is one training forward followed by its backward, or one evaluation (no-grad) forward; each
kind has its own trace. Every gather unit (a module with partitioned parameters) appends an event when it
needs its parameters: `(unit index, phase)`. While the live iteration follows the stored trace, the
coordinator prefetches the units ahead of it and keeps parameters that are reused soon; at the first
event that differs, the trace is invalid for the rest of the iteration (no more prefetch, no retention)
and the iteration's own recording replaces it at the end. Every rank records the same events when every
rank runs the same modules, so decisions taken from the trace (and the collectives they issue) agree.
"""

from __future__ import annotations

import bisect
import enum
import logging
from collections.abc import Callable, Sequence

logger = logging.getLogger(__name__)

__all__ = ["ExecutionTrace", "Phase"]


class Phase(enum.Enum):
    """Which pass of a module needs its parameters gathered."""

    FORWARD = "forward"
    BACKWARD = "backward"


Event = tuple[int, Phase]  # (unit index, phase)

_MAX_RECORDING = 200_000


class ExecutionTrace:
    """One iteration kind's recorded event list, plus the cursor of the iteration in progress.

    Args:
        unit_params: maps a unit index to the ids and element counts of the parameters it gathers now.
    """

    def __init__(self, unit_params: Callable[[int], Sequence[tuple[int, int]]]) -> None:
        self._unit_params = unit_params
        self.events: list[Event] = []
        self._cum: list[int] = [0]
        self._param_positions: dict[int, list[int]] = {}
        self.recording: list[Event] = []
        self.pos = 0
        self.valid = False
        self.warn_on_invalidate = False

    def begin(self) -> None:
        """Start an iteration: replay the stored events if there are any."""
        self.recording = []
        self.pos = 0
        self.valid = bool(self.events)

    def expected(self) -> Event | None:
        """The event the stored trace expects next (None past its end or when not following it)."""
        if self.valid and self.pos < len(self.events):
            return self.events[self.pos]
        return None

    def observe(self, event: Event) -> bool:
        """Record `event`; True while the iteration still follows the stored trace."""
        if len(self.recording) < _MAX_RECORDING:
            self.recording.append(event)
        if self.valid:
            if self.pos < len(self.events) and self.events[self.pos] == event:
                self.pos += 1
                return True
            self.valid = False
            log = logger.warning if self.warn_on_invalidate else logger.debug
            log(
                "stage 3: execution order differs from the recorded trace at event %d (expected %s, got %s); "
                "prefetching stops for this iteration and the trace is re-recorded",
                self.pos,
                self.events[self.pos] if self.pos < len(self.events) else "end",
                event,
            )
        return False

    def commit(self) -> None:
        """End the iteration: a recording that differs from the stored trace replaces it."""
        if self.recording and len(self.recording) < _MAX_RECORDING and self.recording != self.events:
            self._rebuild(self.recording)
        self.recording = []
        self.valid = False

    def discard(self) -> None:
        """Drop this iteration's recording (it was aborted) and stop following the stored trace."""
        self.recording = []
        self.valid = False

    def refresh(self) -> None:
        """Recompute the per-parameter tables (a unit gained an external parameter)."""
        if self.events:
            self._rebuild(self.events)

    def _rebuild(self, events: list[Event]) -> None:
        self.events = list(events)
        cum = [0]
        positions: dict[int, list[int]] = {}
        for i, (unit, _) in enumerate(self.events):
            total = 0
            for pid, numel in self._unit_params(unit):
                total += numel
                positions.setdefault(pid, []).append(i)
            cum.append(cum[-1] + total)
        self._cum = cum
        self._param_positions = positions

    def reuse_distance(self, param_id: int) -> int | None:
        """Elements gathered, from now, before `param_id` is needed again in this iteration (None: never)."""
        if not self.valid:
            return None
        positions = self._param_positions.get(param_id)
        if not positions:
            return None
        i = bisect.bisect_left(positions, self.pos)
        if i == len(positions):
            return None
        return self._cum[positions[i]] - self._cum[self.pos]

    def upcoming(self, start: int) -> range:
        """Positions of the stored events from `start` on (only meaningful while `valid`)."""
        return range(start, len(self.events)) if self.valid else range(0)

    def unit_at(self, position: int) -> int:
        return self.events[position][0]

    def distance_into_next(self, param_id: int) -> int | None:
        """Elements gathered, from now, before `param_id` is first needed in the next iteration, if that one
        follows this trace too (None: not following it, or the parameter is not in it)."""
        if not self.valid:
            return None
        positions = self._param_positions.get(param_id)
        if not positions:
            return None
        return self._cum[-1] - self._cum[self.pos] + self._cum[positions[0]]
