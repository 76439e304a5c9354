"""Gathering ahead along the recorded trace, and reading NVMe-swapped shards ahead of their gathers.

While the iteration follows the stored `ExecutionTrace`, the parameters of the units ahead are gathered
before their modules run: asynchronously once at least half of `prefetch_bucket_size` is free, and, when a
unit must be gathered synchronously anyway, the units right after it ride along in the same collective
(fewer, larger gathers). As in DeepSpeed, `prefetch_bucket_size` is a threshold, not a cap: units are added
while less than it is on its way, so the unit that crosses it still goes. A bucket smaller than one module
(Hugging Face's "auto" is 0.9 * hidden_size**2, below one hidden x hidden weight) then prefetches one module
instead of none. `max_live_parameters` stays a cap. With `offload_param.device="nvme"` the
shards of the units ahead are also read from their swap files into pinned buffers, as far as the swap
buffers allow, so a gather finds its shard in memory. A cursor per activity remembers how far along the
trace it got; both restart with each iteration and stop when the trace breaks.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from torch import nn

from ds_zero._params.partitioned_param import ZeroParamStatus, state_of
from ds_zero._params.shards import prefetch_shards
from ds_zero._schedule.live import LiveParams
from ds_zero._schedule.trace import ExecutionTrace
from ds_zero._schedule.units import GatherUnit

logger = logging.getLogger(__name__)

__all__ = ["Prefetcher"]


class Prefetcher:
    """Prefetch and NVMe read-ahead for one model.

    Args:
        units: the model's gather units, indexed as in the trace events.
        live: the pool gathers are issued through (prefetched parameters join `live.prefetched`).
        prefetch_bucket_size: elements gathered ahead of use (0: no prefetch).
        swappers: the `ParamSwapper`s holding some of the shards on NVMe (empty: no read-ahead).
    """

    def __init__(
        self, units: Sequence[GatherUnit], live: LiveParams, *, prefetch_bucket_size: int, swappers: list[Any]
    ) -> None:
        self.units = units
        self.live = live
        self.prefetch_bucket_size = prefetch_bucket_size
        self.swappers = swappers
        self._cursor = 0
        self._read_cursor = 0

    def restart(self) -> None:
        """A new iteration: look ahead from the start of the trace."""
        self._cursor = 0
        self._read_cursor = 0

    def stop(self) -> None:
        """Forget how far prefetch got and drop the shards read ahead."""
        self._cursor = 0
        self.drop_reads()

    def drop_reads(self) -> None:
        for swapper in self.swappers:
            swapper.drop_prefetched()
        self._read_cursor = 0

    def ride_along(self, trace: ExecutionTrace, reserved: int) -> tuple[list[nn.Parameter], str]:
        """The parameters to add to a synchronous gather of `reserved` elements, and its label suffix."""
        ahead, names = self._batch(trace, reserved)
        return ahead, (f" and {names}" if names else "")

    def advance(self, trace: ExecutionTrace) -> None:
        """After a unit was gathered: prefetch the units ahead, and read their swapped shards ahead."""
        self._prefetch(trace)
        if self.swappers:
            self._read_ahead(trace)

    def _batch(self, trace: ExecutionTrace, reserved: int) -> tuple[list[nn.Parameter], list[str]]:
        """The parameters of the next units in the trace that fit the prefetch budget (advances the cursor).

        `reserved` elements are about to be gathered anyway (they count against `max_live_parameters`).
        """
        live = self.live
        budget = self.prefetch_bucket_size - live.prefetched_numel
        batch: list[nn.Parameter] = []
        names: list[str] = []
        if budget <= 0:
            return batch, names
        ids: set[int] = set()
        size = 0
        cursor = max(self._cursor, trace.pos)
        for position in trace.upcoming(cursor):
            unit = self.units[trace.unit_at(position)]
            cand = [p for p in unit.params if p.ds_status is ZeroParamStatus.NOT_AVAILABLE and p.ds_id not in ids]
            csize = sum(p.ds_numel for p in cand)
            if size >= budget or live.live_numel + reserved + size + csize > live.max_live_parameters:
                break  # the budget is reached (the unit that crossed it went), or the live cap would be
            batch.extend(cand)
            ids.update(p.ds_id for p in cand)
            size += csize
            if cand:
                names.append(unit.name)
            cursor = position + 1
        self._cursor = cursor
        return batch, names

    def _prefetch(self, trace: ExecutionTrace) -> None:
        """Issue an asynchronous gather of the units ahead once at least half the prefetch budget is free."""
        ahead = self.live.prefetched_numel
        if ahead and 2 * ahead > self.prefetch_bucket_size:
            return
        batch, names = self._batch(trace, 0)
        if batch:
            # gathers taken from a followed trace skip the fingerprint check (see `ParamCoordinator.checked`)
            self.live.issue(batch, f"prefetch of modules {names}", async_op=True, checked=not trace.valid)
            for p in batch:
                self.live.prefetched[p.ds_id] = p

    def _read_ahead(self, trace: ExecutionTrace) -> None:
        """Start the NVMe reads of the shards the units ahead will gather, as far as the swap buffers allow."""
        cursor = max(self._read_cursor, trace.pos)
        for position in trace.upcoming(cursor):
            unit = self.units[trace.unit_at(position)]
            cand = [
                p for p in unit.params if state_of(p).swap is not None and p.ds_status is ZeroParamStatus.NOT_AVAILABLE
            ]
            if cand and not prefetch_shards(cand):
                break
            cursor = position + 1
        self._read_cursor = cursor
