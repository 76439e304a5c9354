"""The gathered ("live") parameters of one model: in-flight gathers, the kept and prefetched pools, the count.

Every gather the coordinator issues goes through `LiveParams`, which counts the elements held gathered or
in flight (`live_numel`, the quantity `max_live_parameters` bounds). Two pools hold parameters gathered
although no running module uses them: *retained* (released by their module but needed again soon, see
`max_reuse_distance`) and *prefetched* (gathered ahead of their module). Before a gather would exceed
`max_live_parameters`, parameters of those pools are freed, the retained ones first; parameters in use
(`ZeroParamState.active > 0`) are never freed here, so the peak is bounded by max_live plus the running
units' own parameters.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from torch import nn
from torch.distributed import ProcessGroup

from ds_zero._params.gather import GatherHandle, gather_params
from ds_zero._params.partitioned_param import ZeroParamStatus, state_of
from ds_zero._params.secondary import SecondaryPartition

logger = logging.getLogger(__name__)

__all__ = ["LiveParams"]

RideAlong = Callable[[int], tuple[list[nn.Parameter], str]]
"""Given the elements about to be gathered, the parameters to add to the same collective and a label suffix."""


class LiveParams:
    """Issues, waits for and frees the gathers of one model's partitioned parameters, and counts them.

    Args:
        group: the data-parallel group the parameters are gathered on.
        fp_group: the group for the gather fingerprint check (None when world is 1).
        max_live_parameters: gathered elements kept resident beyond the running modules' own.
        secondary: this rank's hpZ block (None: hpZ off; see `_params.secondary`).
    """

    def __init__(
        self,
        *,
        group: ProcessGroup | None,
        fp_group: ProcessGroup | None,
        max_live_parameters: int,
        secondary: SecondaryPartition | None = None,
    ) -> None:
        self.group = group
        self.fp_group = fp_group
        self.secondary = secondary
        self.max_live_parameters = max_live_parameters
        self.retained: dict[int, nn.Parameter] = {}
        """Released by their modules, kept because the trace needs them again soon (by `ds_id`)."""
        self.prefetched: dict[int, nn.Parameter] = {}
        """Gathered (or in flight) ahead of their modules (by `ds_id`)."""
        self._handles: dict[int, GatherHandle] = {}
        self.live_numel = 0
        """Elements of the parameters gathered or in flight through this object now."""
        self.peak_live_numel = 0
        """The most `live_numel` has been since construction or `reset_peak`."""
        self.num_gathers = 0
        """Collectives issued so far (part of the gather fingerprint)."""
        self.num_param_gathers = 0
        """Parameters gathered so far, counted once per gather (what a fetch-count test compares)."""
        self.num_block_param_gathers = 0
        """Of those, the ones gathered inside the hpZ block from secondary slices."""

    @property
    def prefetched_numel(self) -> int:
        return sum(p.ds_numel for p in self.prefetched.values())

    def reset_peak(self) -> None:
        self.peak_live_numel = self.live_numel

    def issue(self, params: list[nn.Parameter], label: str, *, async_op: bool, checked: bool) -> None:
        """Start the gather of `params` (released ones) as one collective per dtype; wait unless `async_op`."""
        if self.secondary is not None:
            self.num_block_param_gathers += sum(state_of(p).secondary_valid for p in params)
        handles = gather_params(
            params,
            group=self.group,
            fp_group=self.fp_group,
            label=label,
            async_op=async_op,
            checked=checked,
            seq=self.num_gathers,
            secondary=self.secondary,
        )
        self.num_gathers += len(handles)
        self.num_param_gathers += len(params)
        self.live_numel += sum(p.ds_numel for p in params)
        self.peak_live_numel = max(self.peak_live_numel, self.live_numel)
        if async_op:
            for handle in handles:
                for p in handle.params:
                    self._handles[p.ds_id] = handle

    def wait(self, param: nn.Parameter) -> None:
        """Complete the in-flight gather that carries `param` (and every parameter riding in it)."""
        handle = self._handles.get(param.ds_id)
        if handle is None:
            return
        handle.wait()
        for p in handle.params:
            self._handles.pop(p.ds_id, None)

    def wait_inflight(self, params: Sequence[nn.Parameter]) -> None:
        for p in params:
            if p.ds_status is ZeroParamStatus.INFLIGHT:
                self.wait(p)

    def gather(
        self, params: Sequence[nn.Parameter], label: str, *, checked: bool, ride_along: RideAlong | None = None
    ) -> None:
        """Make `params` available now: finish their in-flight gathers, gather the released ones in one go.

        Room is made first (`make_room`); `ride_along` may then add parameters needed soon to the same
        collective (they join the prefetched pool). The units ahead can include this one (a model that is
        one unit runs it again in backward), and its parameters are still released when `ride_along`
        looks: those ride along already, so they are dropped from `ahead` rather than gathered (and
        counted live) twice.
        """
        self.wait_inflight(params)
        missing = [p for p in params if p.ds_status is ZeroParamStatus.NOT_AVAILABLE]
        if not missing:
            return
        need = sum(p.ds_numel for p in missing)
        self.make_room(need)
        ahead, suffix = ride_along(need) if ride_along is not None else ([], "")
        gathering = {p.ds_id for p in missing}
        ahead = [p for p in ahead if p.ds_id not in gathering]
        self.issue(missing + ahead, label + suffix, async_op=False, checked=checked)
        for p in ahead:
            self.prefetched[p.ds_id] = p

    def claim(self, params: Sequence[nn.Parameter]) -> None:
        """Count one more user of each of `params`; a user takes them out of the retained/prefetched pools."""
        for p in params:
            state_of(p).active += 1
            self.prefetched.pop(p.ds_id, None)
            self.retained.pop(p.ds_id, None)

    def free(self, p: nn.Parameter) -> None:
        """Release `p`'s full values (waiting for its gather if in flight) and take it out of the pools."""
        if p.ds_status is ZeroParamStatus.INFLIGHT:
            self.wait(p)
        state_of(p).release()
        self.live_numel -= p.ds_numel
        self.retained.pop(p.ds_id, None)
        self.prefetched.pop(p.ds_id, None)

    def make_room(self, need: int) -> None:
        """Free retained, then prefetched, parameters until `need` more elements fit `max_live_parameters`."""
        for pool in (self.retained, self.prefetched):
            while pool and self.live_numel + need > self.max_live_parameters:
                pid, p = next(iter(pool.items()))
                if state_of(p).active > 0:
                    pool.pop(pid)
                else:
                    self.free(p)

    def drop_retained(self) -> None:
        """Free the retained parameters no one uses (the prediction that kept them no longer holds)."""
        for p in list(self.retained.values()):
            if state_of(p).active == 0:
                self.free(p)
        self.retained.clear()

    def release_unused(self, params: Sequence[nn.Parameter], keep: dict[int, nn.Parameter] | None = None) -> None:
        """Wait for in-flight gathers, then free every non-persistent parameter of `params` no one uses,
        except those in `keep` (by `ds_id`), which become the retained pool."""
        self.wait_inflight(params)
        kept = dict(keep) if keep else {}
        for p in params:
            idle = not p.ds_persist and state_of(p).active == 0 and p.ds_status is ZeroParamStatus.AVAILABLE
            if idle and p.ds_id not in kept:
                self.free(p)
        self.retained = kept
        self.prefetched.clear()

    def regather(self, params: list[nn.Parameter], label: str) -> None:
        """Gather again parameters that are available but whose shards changed (after a step or a load)."""
        if params:
            handles = gather_params(
                params, group=self.group, fp_group=self.fp_group, label=label, checked=True, seq=self.num_gathers
            )
            self.num_gathers += len(handles)
            self.num_param_gathers += len(params)
