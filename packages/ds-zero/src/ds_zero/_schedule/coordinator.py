"""The stage-3 parameter coordinator: which partitioned parameters are gathered when, and when they go.

Each gather unit (`units`) is gathered with one coalesced collective before its module's
forward and again before its backward, and released after each. Around that:

* prefetch: while the iteration follows the recorded trace (`ExecutionTrace`), the units ahead are
  gathered asynchronously, up to `prefetch_bucket_size` elements ahead;
* reuse: a released parameter needed again before `max_reuse_distance` more elements are gathered is kept;
  within a gradient accumulation window that reach extends into the next micro-step's forward (below);
* `max_live_parameters`: kept and prefetched parameters are evicted before a gather would exceed it (the
  parameters in use by running modules always stay, so the peak is bounded by max_live + the running units);
* safety net: saved-tensor hooks replace autograd's references to gathered storage with markers that
  re-gather on unpack, so a backward that no hook anticipated still reads the right values.

[Note: carried into the next micro-step] Between the micro-steps of one gradient accumulation window no
optimizer step runs, so the shards do not change and a parameter gathered at the end of one backward holds
the values the next forward would gather. DeepSpeed releases everything at the end of each backward and
gathers it all again; with a model whose gathers are mostly per-collective latency (Hugging Face's "auto"
buckets on a small model: one collective per module) that is a third of the step. When the optimizer is told
the window continues (`set_step_boundary(False)`, which the engine says before every backward but the last
of a window), the backward's releases measure reuse across the iteration's end: a parameter whose next use
is early in the next forward, fewer than `max_reuse_distance` gathered elements away, stays in the retained
pool through the iteration's end, evicted first when a gather would pass `max_live_parameters` (as retained
ones always are); what is carried is what the next forward would gather first anyway. A step, a load or a
refresh of the weights releases (or re-gathers) every gathered parameter first (`refresh_gathered`), so a
carried value never outlives the shards it came from, whatever the caller said.

Those three live in their own modules (`live.LiveParams`, `prefetch.Prefetcher`,
`saved_tensors.SavedTensorNet`); this one keeps the module stack, the iteration edges, the trace
and the on-demand paths (a parameter read inside a forward, `GatheredParameters`, a parameter a
forward returns: the caller takes it over as an external parameter and releases it at its own end).

All decisions depend only on the sequence of module calls, which is the same on every rank when every
rank runs the same modules. Gathers that follow the shared trace skip the fingerprint; the others (the
first iteration, after a change of execution order, on-demand gathers) are checked, and a rank whose
execution leaves the trace checks with the others at once, so a rank that diverges is reported instead
of meeting a different collective (see `_params.gather`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

import ds_comm
from ds_zero._params.gather import check_same_gather, name_fingerprint, report_deviation
from ds_zero._params.gathered_parameters import external_params
from ds_zero._params.param_dict import ensure_zero_ordered_dict
from ds_zero._params.partitioned_param import ZeroParamStatus, state_of
from ds_zero._params.secondary import SecondaryPartition, invalidate_secondaries
from ds_zero._params.storage_pool import released_storages
from ds_zero._schedule.live import LiveParams
from ds_zero._schedule.prefetch import Prefetcher
from ds_zero._schedule.returned_params import returned_params
from ds_zero._schedule.saved_tensors import SavedTensorNet
from ds_zero._schedule.trace import Event, ExecutionTrace, Phase
from ds_zero._schedule.units import GatherUnit, UnitRegistry

logger = logging.getLogger(__name__)

__all__ = ["ParamCoordinator"]


@dataclasses.dataclass(slots=True, eq=False)
class _Frame:
    """One running forward on the coordinator's module stack."""

    module: nn.Module
    unit: GatherUnit | None
    """The module's gather unit (None: it has no partitioned parameters, only marks the nesting)."""
    holds: bool = False
    """Whether this call claimed `unit`'s parameters (released by the matching `post_forward`)."""


class ParamCoordinator:
    """Gathers, prefetches and releases the partitioned parameters of one model.

    Args:
        root: the model; every parameter in it must already be partitioned.
        group: a group over the data-parallel ranks used only for parameter all-gathers.
        fp_group: another group over the same ranks for the gather fingerprint (None when world is 1).
        prefetch_bucket_size: elements gathered ahead of use (0: no prefetch).
        max_live_parameters: gathered elements kept resident beyond the running modules' own.
        max_reuse_distance: keep a released parameter needed again before this many elements are gathered
            (fewer than it in between, as DeepSpeed counts: 0 keeps nothing).
        log_trace_cache_warnings: warn (instead of debug-log) when the execution order changes.
        secondary: this rank's hpZ block (None: hpZ off). Gathers of parameters gathered earlier in the
            same iteration run inside the block; the secondary slices go stale at each iteration's end.
    """

    def __init__(
        self,
        root: nn.Module,
        *,
        group: ProcessGroup | None,
        fp_group: ProcessGroup | None,
        prefetch_bucket_size: int,
        max_live_parameters: int,
        max_reuse_distance: int,
        log_trace_cache_warnings: bool = False,
        secondary: SecondaryPartition | None = None,
    ) -> None:
        self.root = root
        self.group = group
        self.fp_group = fp_group
        self.max_reuse_distance = max_reuse_distance
        self._traces: dict[str, ExecutionTrace] = {}
        self.registry = UnitRegistry(root, self, self._refresh_traces)
        self.units = self.registry.units
        self.params = self.registry.params
        self._traces = {kind: ExecutionTrace(self.registry.param_info) for kind in ("train", "eval")}
        for trace in self._traces.values():
            trace.warn_on_invalidate = log_trace_cache_warnings
        self._trace: ExecutionTrace | None = None
        self._stack: list[_Frame] = []
        self._in_backward = False
        self._bwd_uses: list[GatherUnit] = []
        self._held: list[nn.Parameter] = []
        self.live = LiveParams(
            group=group, fp_group=fp_group, max_live_parameters=max_live_parameters, secondary=secondary
        )
        # NVMe-swapped shards (offload_param.device="nvme"): read ahead along the trace, dropped when it breaks
        swappers = {id(s.swap): s.swap for s in map(state_of, self.params) if s.swap is not None}
        self.prefetcher = Prefetcher(
            self.units, self.live, prefetch_bucket_size=prefetch_bucket_size, swappers=list(swappers.values())
        )
        self.saved_tensors = SavedTensorNet(self.registry, self.live, self._hold)
        released_storages.reserve(_pool_bytes(self.params))
        self.end_of_backward_callbacks: list[Any] = []
        #: Set for one backward by the optimizer when the next iteration continues its gradient accumulation
        #: window (no step in between): see [Note: carried into the next micro-step].
        self.carry_into_next = False

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
        if self.live.secondary is not None:  # slices filled outside an iteration may predate a step: not used
            invalidate_secondaries(self.params)
        self._trace = self._traces["train" if torch.is_grad_enabled() else "eval"]
        self._trace.begin()
        self.prefetcher.restart()

    def _end_iteration(self) -> None:
        trace = self._trace
        if trace is not None and trace.valid and trace.pos < len(trace.events):
            expected = trace.expected()
            trace.valid = False
            self._left_trace(None, expected)
        for p in self._held:
            state_of(p).active -= 1
        self._held.clear()
        if self.carry_into_next and trace is self._traces["train"]:
            self.live.release_unused(self.params, keep=self.live.retained)
            self.prefetcher.stop()
        else:
            self.release_unused()
        self.carry_into_next = False
        if self._trace is not None:
            self._trace.commit()
        self._trace = None
        if self.live.secondary is not None:  # an optimizer step may change the shards before the next gather
            invalidate_secondaries(self.params)

    def pre_forward(self, module: nn.Module) -> None:
        if not self._stack and self._in_backward and torch._C._current_graph_task_id() == -1:
            self._drain_aborted_backward()
        if not self._stack and not self._in_backward:
            # submodules attached after the model was wrapped read their parameters through a
            # ZeroParamDict too, so a partitioned parameter they share is gathered on access
            for m in self.root.modules():
                ensure_zero_ordered_dict(m)
            if self._trace is None:
                self._begin_iteration()
            if torch.is_grad_enabled():
                self.saved_tensors.enter()
        unit = self.registry.unit_for(module)
        frame = _Frame(module, unit)
        self._stack.append(frame)
        if unit is not None:
            self._use(unit, Phase.FORWARD)
            frame.holds = True

    def post_forward(self, module: nn.Module, output: Any = None) -> None:
        """`module`'s forward returned `output`: keep the parameters in it for the caller, release the rest."""
        if not self._stack:
            return
        frame = self._stack.pop()
        while frame.module is not module and self._stack:  # an exception skipped inner post-hooks
            frame = self._stack.pop()
        handed = [p for p in returned_params(output) if self._hand_to_caller(p)]
        if frame.holds and frame.unit is not None:
            self._release(frame.unit)
        if handed and self._stack[-1].module is not module:  # (a module calling itself keeps what it took)
            own = external_params(module)
            for param in handed:
                if own.pop(id(param), None) is not None:  # the caller took it over: this module lets it go
                    self.remove_external(module, param)
        if not self._stack and not self._in_backward:
            self.saved_tensors.exit()
            if self._trace is self._traces["eval"]:
                self._end_iteration()

    def pre_backward(self, module: nn.Module) -> None:
        self.ensure_backward()
        unit = self.registry.unit_for(module)
        if unit is not None:
            self._use(unit, Phase.BACKWARD)
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

    def _drain_aborted_backward(self) -> None:
        """Finish the iteration of a backward that raised: autograd skips queued callbacks on an error.

        Called when a forward starts at the root while a backward is still marked running but autograd runs
        none (an exception in a backward hook, a node, or a checkpoint replay). Its claims are released,
        its parameters freed and its partial recording dropped, so the retry starts a clean iteration. The
        end-of-backward callbacks do not run: the aborted backward's gradients are incomplete anyway.
        """
        logger.warning("stage 3: the previous backward did not finish (it raised); releasing what it held")
        for unit in self._bwd_uses:
            self._release(unit)
        self._bwd_uses.clear()
        self._in_backward = False
        if self._trace is not None:
            self._trace.discard()
        self._end_iteration()

    # ---------------------------------------------------------------------------- gather and release
    def _use(self, unit: GatherUnit, phase: Phase) -> None:
        trace = self._trace
        if trace is not None:
            was_valid = trace.valid
            expected = trace.expected()
            if not trace.observe((unit.index, phase)) and was_valid:
                self._left_trace((unit.index, phase), expected)
        if not unit.params:
            return
        following = trace is not None and trace.valid
        # the units right after this one ride along in the same collective (fewer, larger gathers)
        ride_along = (lambda need: self.prefetcher.ride_along(trace, need)) if following else None
        self.live.gather(unit.params, f"module {unit.name!r}", checked=self.checked, ride_along=ride_along)
        self.live.claim(unit.params)
        if following:
            self.prefetcher.advance(trace)

    def _describe(self, event: Event | None) -> str:
        if event is None:
            return "the end of the iteration"
        return f"module {self.units[event[0]].name!r} ({event[1].value})"

    def _left_trace(self, event: Event | None, expected: Event | None) -> None:
        """This rank's execution stopped following the trace: drop what the trace predicted, tell the others.

        The ranks that left the trace the same way exchange a fingerprint at once (and then continue with
        checked gathers); a rank that left alone waits there until the collective timeout and reports.
        """
        self.live.drop_retained()  # parameters kept because of the trace go
        self.prefetcher.drop_reads()
        message = (
            f"rank {ds_comm.get_rank()} ran {self._describe(event)} where the recorded execution order "
            f"expected {self._describe(expected)}"
        )
        report_deviation(message)
        check_same_gather(
            [],
            f"after leaving the recorded execution order: {message}",
            self.fp_group,
            self.live.num_gathers,
            tag=name_fingerprint(self._describe(event)),
        )

    def _release(self, unit: GatherUnit) -> None:
        trace = self._trace
        for p in unit.params:
            st = state_of(p)
            st.active -= 1
            if st.active > 0 or p.ds_status is not ZeroParamStatus.AVAILABLE:
                continue
            distance = trace.reuse_distance(p.ds_id) if trace is not None else None
            if distance is None and self.carry_into_next and self._in_backward and trace is not None:
                distance = trace.distance_into_next(p.ds_id)
            if distance is not None and distance < self.max_reuse_distance:
                self.live.retained[p.ds_id] = p
            else:
                self.live.free(p)

    def _hold(self, param: nn.Parameter) -> None:
        """Keep `param` gathered until the end of the iteration."""
        state_of(param).active += 1
        self._held.append(param)

    def release_unused(self) -> None:
        """Wait for in-flight gathers, then free every gathered parameter no running module or block uses."""
        self.live.release_unused(self.params)
        self.prefetcher.stop()

    # ------------------------------------------------------------------------------ on-demand paths
    def fetch_on_access(self, param: nn.Parameter) -> None:
        """A running forward read a released parameter through `module.<name>`: gather it now."""
        if not self.running:
            return
        frame = self._stack[-1] if self._stack else None
        where = self.registry.name_of(frame.module) if frame else "backward"
        name = state_of(param).name
        self.live.gather([param], f"parameter {name!r} read in module {where!r}", checked=True)
        if frame is not None and not param.ds_persist:
            self._attach(frame, param)
        else:
            self._hold(param)
        logger.debug("stage 3: gathered %s on access from %s", name, where)

    def _attach(self, frame: _Frame, param: nn.Parameter) -> None:
        """Gather the gathered `param` with `frame`'s module from now on, and claim it for this call."""
        state_of(param).active += 1
        unit = self.add_external(frame.module, param)
        if unit is None:
            self._held.append(param)
        elif not frame.holds:
            frame.unit, frame.holds = unit, True
            for p in unit.params:
                if p is not param:
                    state_of(p).active += 1

    def _hand_to_caller(self, param: nn.Parameter) -> bool:
        """A finished forward returned `param`: make the calling module gather it (DeepSpeed's "external parameter").

        Nothing to do when a running module already gathers it (it owns it, or took it over earlier) or it is
        persistent. The root's own return is held to the end of the iteration. True when the caller took it.
        [Note: the forward just used `param`, so it is gathered; the claim added here keeps it so past this
        module's release, and from the next iteration on the caller's gather (and the trace) include it.]
        """
        if state_of(param).coord is not self or param.ds_persist:
            return False
        if any(f.holds and f.unit is not None and any(p is param for p in f.unit.params) for f in self._stack):
            return False
        if not self._stack:
            self._hold(param)
            return False
        caller = self._stack[-1]
        param.is_external_param = True  # DeepSpeed's flag: stays set, as the caller gathers it from now on
        external_params(caller.module)[id(param)] = param
        self._attach(caller, param)
        logger.debug(
            "stage 3: %s returned to module %r, gathered with it from now on",
            state_of(param).name,
            self.registry.name_of(caller.module),
        )
        return True

    def gather_explicit(self, params: list[nn.Parameter], label: str) -> None:
        """Gather `params` and hold them until `release_explicit` (GatheredParameters)."""
        self.live.wait_inflight(params)
        self.live.gather([p for p in params if not p.ds_persist], label, checked=True)
        self.live.claim(params)

    def refresh(self, params: list[nn.Parameter], label: str) -> None:
        """Re-gather parameters that are available but whose shards changed (after a step or a load)."""
        self.live.regather(params, label)

    def consumers_of(self, ds_id: int) -> list[str]:
        """Name the running module calls and end-of-iteration holds that claim parameter `ds_id`
        (`param.ds_active_sub_modules`)."""
        names = [
            f"module {f.unit.name!r} (forward)"
            for f in self._stack
            if f.holds and f.unit is not None and any(p.ds_id == ds_id for p in f.unit.params)
        ]
        names += [f"module {u.name!r} (backward)" for u in self._bwd_uses if any(p.ds_id == ds_id for p in u.params)]
        names += ["held to the end of the iteration" for p in self._held if p.ds_id == ds_id]
        return names

    def release_explicit(self, params: list[nn.Parameter]) -> None:
        for p in params:
            st = state_of(p)
            st.active -= 1
            if st.active == 0 and not p.ds_persist and p.ds_status is ZeroParamStatus.AVAILABLE and not self.running:
                self.live.free(p)


def _pool_bytes(params: list[nn.Parameter]) -> int:
    """What the released-storage pool may hold for this model: three of its largest full storages (a weight
    gathered ahead, one in use and its gradient; see [Note: why released full storages are pooled])."""
    return 3 * max((state_of(p).full_flat.numel() * p.element_size() for p in params), default=0)
