"""The stage-3 parameter coordinator: which partitioned parameters are gathered when, and when they go.

Each gather unit (`_stage3_units`) is gathered with one coalesced collective before its module's
forward and again before its backward, and released after each. Around that:

* prefetch: while the iteration follows the recorded trace (`ExecutionTrace`), the units ahead are
  gathered asynchronously, up to `prefetch_bucket_size` elements ahead;
* reuse: a released parameter needed again within `max_reuse_distance` gathered elements is kept;
* `max_live_parameters`: kept and prefetched parameters are evicted before a gather would exceed it (the
  parameters in use by running modules always stay, so the peak is bounded by max_live + the running units);
* safety net: saved-tensor hooks replace autograd's references to gathered storage with markers that
  re-gather on unpack, so a backward that no hook anticipated still reads the right values.

All decisions depend only on the sequence of module calls, which is the same on every rank when every
rank runs the same modules. Gathers that follow the shared trace skip the fingerprint; the others (the
first iteration, after a change of execution order, on-demand gathers) are checked, and a rank whose
execution leaves the trace checks with the others at once, so a rank that diverges is reported instead
of meeting a different collective (see `_gather`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

import ds_comm
from ds_zero._gather import GatherHandle, check_same_gather, gather_params, name_fingerprint, report_deviation
from ds_zero._partitioned_param import ZeroParamStatus, free_full, prefetch_shards, state_of
from ds_zero._stage3_trace import ExecutionTrace
from ds_zero._stage3_units import GatherUnit, UnitRegistry

logger = logging.getLogger(__name__)

__all__ = ["ParamCoordinator"]


class ParamCoordinator:
    """Gathers, prefetches and releases the partitioned parameters of one model.

    Args:
        root: the model; every parameter in it must already be partitioned.
        group: a group over the data-parallel ranks used only for parameter all-gathers.
        fp_group: another group over the same ranks for the gather fingerprint (None when world is 1).
        prefetch_bucket_size: elements gathered ahead of use (0: no prefetch).
        max_live_parameters: gathered elements kept resident beyond the running modules' own.
        max_reuse_distance: keep a released parameter needed again within this many gathered elements.
        log_trace_cache_warnings: warn (instead of debug-log) when the execution order changes.
    """

    def __init__(self, root: nn.Module, *, group: ProcessGroup | None, fp_group: ProcessGroup | None,
                 prefetch_bucket_size: int, max_live_parameters: int, max_reuse_distance: int,
                 log_trace_cache_warnings: bool = False) -> None:
        self.root = root
        self.group = group
        self.fp_group = fp_group
        self.prefetch_bucket_size = prefetch_bucket_size
        self.max_live_parameters = max_live_parameters
        self.max_reuse_distance = max_reuse_distance
        self._traces: dict[str, ExecutionTrace] = {}
        self.registry = UnitRegistry(root, self, self._refresh_traces)
        self.units = self.registry.units
        self.params = self.registry.params
        self._traces = {kind: ExecutionTrace(self.registry.param_info) for kind in ("train", "eval")}
        for trace in self._traces.values():
            trace.warn_on_invalidate = log_trace_cache_warnings
        self._trace: ExecutionTrace | None = None
        self._stack: list[list[Any]] = []  # [module, unit or None, used]
        self._in_backward = False
        self._bwd_uses: list[GatherUnit] = []
        self._handles: dict[int, GatherHandle] = {}
        self._retained: dict[int, nn.Parameter] = {}
        self._prefetched: dict[int, nn.Parameter] = {}
        self._held: list[nn.Parameter] = []
        self._prefetch_cursor = 0
        self._read_cursor = 0
        # NVMe-swapped shards (offload_param.device="nvme"): read ahead along the trace, dropped when it breaks
        swappers = {id(s.swap): s.swap for s in map(state_of, self.params) if s.swap is not None}
        self.swappers: list[Any] = list(swappers.values())
        self._saved_hooks: Any = None
        self.end_of_backward_callbacks: list[Any] = []
        self.live_numel = 0
        self.peak_live_numel = 0
        self.num_gathers = 0

    # ----------------------------------------------------------------------------------------- units
    def _refresh_traces(self) -> None:
        for trace in self._traces.values():
            trace.refresh()

    def unit_for(self, module: nn.Module) -> GatherUnit | None:
        return self.registry.unit_for(module)

    def gathers_for(self, module: nn.Module) -> bool:
        """Whether `module` has parameters to gather (and so needs backward hooks)."""
        unit = self.registry.unit_for(module)
        return unit is not None and bool(unit.params)

    def add_external(self, module: nn.Module, param: nn.Parameter) -> GatherUnit | None:
        """Gather `param` with `module` from now on (DeepSpeed's `register_external_parameter`)."""
        return self.registry.add_external(module, param)

    def remove_external(self, module: nn.Module, param: nn.Parameter) -> None:
        self.registry.remove_external(module, param)

    def storage_replaced(self, old_key: int, param: nn.Parameter) -> None:
        self.registry.storage_replaced(old_key, param)

    @property
    def checked(self) -> bool:
        """Whether gathers now need the fingerprint check (no shared trace is being followed)."""
        return self._trace is None or not self._trace.valid

    # ------------------------------------------------------------------------------- iteration edges
    @property
    def running(self) -> bool:
        """Whether a forward or backward of this model is in progress."""
        return bool(self._stack) or self._in_backward

    def _begin_iteration(self) -> None:
        self._trace = self._traces["train" if torch.is_grad_enabled() else "eval"]
        self._trace.begin()
        self._prefetch_cursor = 0
        self._read_cursor = 0

    def _end_iteration(self) -> None:
        trace = self._trace
        if trace is not None and trace.valid and trace.pos < len(trace.events):
            expected = trace.expected()
            trace.valid = False
            self._left_trace(None, expected)
        for p in self._held:
            state_of(p).active -= 1
        self._held.clear()
        self.release_unused()
        if self._trace is not None:
            self._trace.commit()
        self._trace = None

    def pre_forward(self, module: nn.Module) -> None:
        if not self._stack and not self._in_backward:
            if self._trace is None:
                self._begin_iteration()
            if torch.is_grad_enabled() and self._saved_hooks is None:
                self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
                self._saved_hooks.__enter__()
        unit = self.registry.unit_for(module)
        entry = [module, unit, False]
        self._stack.append(entry)
        if unit is not None:
            self._use(unit, 0)
            entry[2] = True

    def post_forward(self, module: nn.Module) -> None:
        if not self._stack:
            return
        entry = self._stack.pop()
        while entry[0] is not module and self._stack:  # an exception skipped inner post-hooks
            entry = self._stack.pop()
        if entry[2]:
            self._release(entry[1])
        if not self._stack and not self._in_backward:
            if self._saved_hooks is not None:
                self._saved_hooks.__exit__(None, None, None)
                self._saved_hooks = None
            if self._trace is self._traces["eval"]:
                self._end_iteration()

    def pre_backward(self, module: nn.Module) -> None:
        self.ensure_backward()
        unit = self.registry.unit_for(module)
        if unit is not None:
            self._use(unit, 1)
            self._bwd_uses.append(unit)

    def post_backward(self, module: nn.Module) -> None:
        unit = self.registry.unit_for(module)
        if unit is None:
            return
        for i in range(len(self._bwd_uses) - 1, -1, -1):
            if self._bwd_uses[i] is unit:
                del self._bwd_uses[i]
                self._release(unit)
                return

    def ensure_backward(self) -> None:
        """Mark a backward as running and queue the end-of-backward work (call from inside backward)."""
        if self._in_backward:
            return
        self._in_backward = True
        if self._trace is None:
            self._begin_iteration()
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        try:
            for callback in self.end_of_backward_callbacks:
                callback()
        finally:
            for unit in self._bwd_uses:
                self._release(unit)
            self._bwd_uses.clear()
            self._in_backward = False
            self._end_iteration()

    # ---------------------------------------------------------------------------- gather and release
    def _use(self, unit: GatherUnit, phase: int) -> None:
        trace = self._trace
        if trace is not None:
            was_valid = trace.valid
            expected = trace.expected()
            if not trace.observe((unit.index, phase)) and was_valid:
                self._left_trace((unit.index, phase), expected)
        if not unit.params:
            return
        following = trace is not None and trace.valid
        for p in unit.params:
            if p.ds_status is ZeroParamStatus.INFLIGHT:
                self._wait(p)
        missing = [p for p in unit.params if p.ds_status is ZeroParamStatus.NOT_AVAILABLE]
        if missing:
            self._make_room(sum(p.ds_numel for p in missing))
            ahead, names = self._prefetch_batch(trace, sum(p.ds_numel for p in missing)) if following else ([], [])
            # the units right after this one ride along in the same collective (fewer, larger gathers)
            self._issue(missing + ahead, f"module {unit.name!r}" + (f" and {names}" if names else ""),
                        async_op=False)
            for p in ahead:
                self._prefetched[p.ds_id] = p
        for p in unit.params:
            state_of(p).active += 1
            self._prefetched.pop(p.ds_id, None)
            self._retained.pop(p.ds_id, None)
        if following:
            self._prefetch(trace)
            if self.swappers:
                self._read_ahead(trace)

    def _read_ahead(self, trace: ExecutionTrace) -> None:
        """Start the NVMe reads of the shards the units ahead will gather, as far as the swap buffers allow."""
        cursor = max(self._read_cursor, trace.pos)
        for position in trace.upcoming(cursor):
            unit = self.units[trace.unit_at(position)]
            cand = [p for p in unit.params
                    if state_of(p).swap is not None and p.ds_status is ZeroParamStatus.NOT_AVAILABLE]
            if cand and not prefetch_shards(cand):
                break
            cursor = position + 1
        self._read_cursor = cursor

    def _drop_reads(self) -> None:
        for swapper in self.swappers:
            swapper.drop_prefetched()
        self._read_cursor = 0

    def _describe(self, event: tuple[int, int] | None) -> str:
        if event is None:
            return "the end of the iteration"
        return f"module {self.units[event[0]].name!r} ({'forward' if event[1] == 0 else 'backward'})"

    def _left_trace(self, event: tuple[int, int] | None, expected: tuple[int, int] | None) -> None:
        """This rank's execution stopped following the trace: drop what the trace predicted, tell the others.

        The ranks that left the trace the same way exchange a fingerprint at once (and then continue with
        checked gathers); a rank that left alone waits there until the collective timeout and reports.
        """
        self._drop_predictions()
        message = (f"rank {ds_comm.get_rank()} ran {self._describe(event)} where the recorded execution order "
                   f"expected {self._describe(expected)}")
        report_deviation(message)
        check_same_gather([], f"after leaving the recorded execution order: {message}", self.fp_group, self.num_gathers,
                          tag=name_fingerprint(self._describe(event)))

    def _fetch(self, params: list[nn.Parameter], label: str) -> None:
        for p in params:
            if p.ds_status is ZeroParamStatus.INFLIGHT:
                self._wait(p)
        missing = [p for p in params if p.ds_status is ZeroParamStatus.NOT_AVAILABLE]
        if missing:
            self._make_room(sum(p.ds_numel for p in missing))
            self._issue(missing, label, async_op=False)

    def _issue(self, params: list[nn.Parameter], label: str, async_op: bool, checked: bool | None = None) -> None:
        handles = gather_params(params, group=self.group, fp_group=self.fp_group, label=label, async_op=async_op,
                                checked=self.checked if checked is None else checked, seq=self.num_gathers)
        self.num_gathers += len(handles)
        self.live_numel += sum(p.ds_numel for p in params)
        self.peak_live_numel = max(self.peak_live_numel, self.live_numel)
        if async_op:
            for handle in handles:
                for p in handle.params:
                    self._handles[p.ds_id] = handle

    def _wait(self, param: nn.Parameter) -> None:
        handle = self._handles.get(param.ds_id)
        if handle is None:
            return
        handle.wait()
        for p in handle.params:
            self._handles.pop(p.ds_id, None)

    def _release(self, unit: GatherUnit) -> None:
        trace = self._trace
        for p in unit.params:
            state_of(p).active -= 1
            if state_of(p).active > 0 or p.ds_status is not ZeroParamStatus.AVAILABLE:
                continue
            distance = trace.reuse_distance(p.ds_id) if trace is not None else None
            if distance is not None and distance <= self.max_reuse_distance:
                self._retained[p.ds_id] = p
            else:
                self._free(p)

    def _free(self, p: nn.Parameter) -> None:
        if p.ds_status is ZeroParamStatus.INFLIGHT:
            self._wait(p)
        free_full(p)
        self.live_numel -= p.ds_numel
        self._retained.pop(p.ds_id, None)
        self._prefetched.pop(p.ds_id, None)

    def _make_room(self, need: int) -> None:
        for pool in (self._retained, self._prefetched):
            while pool and self.live_numel + need > self.max_live_parameters:
                pid, p = next(iter(pool.items()))
                if state_of(p).active > 0:
                    pool.pop(pid)
                else:
                    self._free(p)

    def _drop_predictions(self) -> None:
        """The trace stopped matching: parameters kept because of it go."""
        for p in list(self._retained.values()):
            if state_of(p).active == 0:
                self._free(p)
        self._retained.clear()
        self._drop_reads()

    def _prefetch_batch(self, trace: ExecutionTrace, reserved: int) -> tuple[list[nn.Parameter], list[str]]:
        """The parameters of the next units in the trace that fit the prefetch budget (advances the cursor).

        `reserved` elements are about to be gathered anyway (they count against `max_live_parameters`).
        """
        ahead = sum(p.ds_numel for p in self._prefetched.values())
        budget = self.prefetch_bucket_size - ahead
        batch: list[nn.Parameter] = []
        names: list[str] = []
        if budget <= 0:
            return batch, names
        ids: set[int] = set()
        size = 0
        cursor = max(self._prefetch_cursor, trace.pos)
        for position in trace.upcoming(cursor):
            unit = self.units[trace.unit_at(position)]
            cand = [p for p in unit.params if p.ds_status is ZeroParamStatus.NOT_AVAILABLE and p.ds_id not in ids]
            csize = sum(p.ds_numel for p in cand)
            if size + csize > budget or self.live_numel + reserved + size + csize > self.max_live_parameters:
                break
            batch.extend(cand)
            ids.update(p.ds_id for p in cand)
            size += csize
            if cand:
                names.append(unit.name)
            cursor = position + 1
        self._prefetch_cursor = cursor
        return batch, names

    def _prefetch(self, trace: ExecutionTrace) -> None:
        """Issue an asynchronous gather of the units ahead once at least half the prefetch budget is free."""
        ahead = sum(p.ds_numel for p in self._prefetched.values())
        if ahead and 2 * ahead > self.prefetch_bucket_size:
            return
        batch, names = self._prefetch_batch(trace, 0)
        if batch:
            self._issue(batch, f"prefetch of modules {names}", async_op=True)
            for p in batch:
                self._prefetched[p.ds_id] = p

    def release_unused(self) -> None:
        """Wait for in-flight gathers, then free every gathered parameter no running module or block uses."""
        for p in self.params:
            if p.ds_status is ZeroParamStatus.INFLIGHT:
                self._wait(p)
        for p in self.params:
            if not p.ds_persist and state_of(p).active == 0 and p.ds_status is ZeroParamStatus.AVAILABLE:
                self._free(p)
        self._retained.clear()
        self._prefetched.clear()
        self._prefetch_cursor = 0
        self._drop_reads()

    # ------------------------------------------------------------------------------ on-demand paths
    def fetch_on_access(self, param: nn.Parameter) -> None:
        """A running forward read a released parameter through `module.<name>`: gather it now."""
        if not self.running:
            return
        if param.ds_status is ZeroParamStatus.INFLIGHT:
            self._wait(param)
        entry = self._stack[-1] if self._stack else None
        where = self.registry.name_of(entry[0]) if entry else "backward"
        if param.ds_status is ZeroParamStatus.NOT_AVAILABLE:
            self._make_room(param.ds_numel)
            self._issue([param], f"parameter {state_of(param).name!r} read in module {where!r}", async_op=False,
                        checked=True)
        state_of(param).active += 1
        if entry is not None and not param.ds_persist:
            unit = self.add_external(entry[0], param)
            if unit is not None and not entry[2]:
                entry[1], entry[2] = unit, True
                for p in unit.params:
                    if p is not param:
                        state_of(p).active += 1
            if unit is None:
                self._held.append(param)
        else:
            self._held.append(param)
        logger.debug("stage 3: gathered %s on access from %s", state_of(param).name, where)

    def gather_explicit(self, params: list[nn.Parameter], label: str) -> None:
        """Gather `params` and hold them until `release_explicit` (GatheredParameters)."""
        for p in params:
            if p.ds_status is ZeroParamStatus.INFLIGHT:
                self._wait(p)
        missing = [p for p in params if p.ds_status is ZeroParamStatus.NOT_AVAILABLE and not p.ds_persist]
        if missing:
            self._make_room(sum(p.ds_numel for p in missing))
            self._issue(missing, label, async_op=False, checked=True)
        for p in params:
            state_of(p).active += 1
            self._prefetched.pop(p.ds_id, None)
            self._retained.pop(p.ds_id, None)

    def refresh(self, params: list[nn.Parameter], label: str) -> None:
        """Re-gather parameters that are available but whose shards changed (after a step or a load)."""
        if params:
            handles = gather_params(params, group=self.group, fp_group=self.fp_group, label=label,
                                    checked=True, seq=self.num_gathers)
            self.num_gathers += len(handles)

    def release_explicit(self, params: list[nn.Parameter]) -> None:
        for p in params:
            state_of(p).active -= 1
            if state_of(p).active == 0 and not p.ds_persist and p.ds_status is ZeroParamStatus.AVAILABLE \
                    and not self.running:
                self._free(p)

    # ------------------------------------------------------------------------- saved-tensor hooks
    def _pack(self, tensor: torch.Tensor) -> Any:
        try:
            key = tensor.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError, TypeError, AttributeError):  # no plain storage (sparse, ...)
            return tensor
        param = self.registry.param_for_storage(key)
        if param is None:
            return tensor
        return (param, tensor.size(), tensor.stride(), tensor.storage_offset())

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        param, size, stride, offset = packed
        if param.ds_status is not ZeroParamStatus.AVAILABLE:
            if param.ds_status is ZeroParamStatus.INFLIGHT:
                self._wait(param)
            else:
                self._make_room(param.ds_numel)
                self._issue([param], f"parameter {state_of(param).name!r} needed by backward", async_op=False,
                            checked=True)
                logger.debug("stage 3: backward needed %s before any hook gathered it", state_of(param).name)
            state_of(param).active += 1
            self._held.append(param)
        return state_of(param).full.as_strided(size, stride, offset)
