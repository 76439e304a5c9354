"""`SpeculativeSteps`: update sub-groups ahead of the step's decision, on a worker thread, and undo them when needed.

[Note: speculate, then settle] Whether a step is applied, and with what gradient, is known only after the
whole gradient is: an inf/nan anywhere skips it (fp16, `bf16.check_grad_overflow`), a global norm above
`gradient_clipping` scales every gradient, and the hyper-parameters may still change before `step()`.
Waiting for that leaves the CPU optimizer idle through the backward. Instead each sub-group is updated
as soon as its own gradient is complete, on one worker thread that overlaps the rest of the backward,
assuming the common case (applied, not clipped). Before updating, the worker copies what the update
overwrites: the sub-group's master values and its optimizer state (the Adam moments, the step count),
so undoing is one copy back and is exact (no inverse of the update, no rounding). At the step the
caller *settles*: the speculative updates stand (common case), or all are undone (skipped step) and
the caller redoes them with the final gradient (clipped step, changed hyper-parameters), or one is
undone because its gradient changed after it was updated (a late second gradient).

The mechanism knows nothing of ZeRO: a unit is any `(key, param)` the base optimizer steps alone, and
the caller supplies the function that steps it. SuperOffload (`ds_zero._stage3.superoffload`) feeds it
the CPU sub-groups of ZeRO-3; ZeRO-Infinity's in-backward update of NVMe sub-groups
(`ds_zero._nvme.eager_step`) uses the same undo records, with the master and the moments' pre-update
copies left in the swap files the update did not overwrite (`UndoRecord`'s `elsewhere`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Hashable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = ["SpeculativeSteps", "UndoRecord"]


def _copy_value(value: Any, spare: dict[str, torch.Tensor] | None = None, name: str = "") -> Any:
    """A copy of `value`; a tensor goes into `spare[name]` when that fits (kept between steps: no fresh
    allocation, whose first touch of every page costs as much as the copy itself)."""
    if not isinstance(value, torch.Tensor):
        return value
    if spare is None:
        return value.detach().clone()
    buf = spare.get(name)
    if buf is None or buf.shape != value.shape or buf.dtype != value.dtype or buf.device != value.device:
        buf = spare[name] = torch.empty_like(value, memory_format=torch.contiguous_format)
    with torch.no_grad():
        buf.copy_(value)
    return buf


def hyper_of(group: dict[str, Any]) -> dict[str, Any]:
    """A copy of a param group's hyper-parameters (everything but its params)."""
    return {k: _copy_value(v) for k, v in group.items() if k != "params"}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return bool(a == b)


class UndoRecord:
    """What one speculative update overwrote: the parameter's values, its optimizer state, and the group's
    hyper-parameters the update used (to notice a change before the step).

    `elsewhere`: what the caller keeps the pre-update copy of itself, so the record neither copies nor
    restores it: `VALUES` for the parameter's values, and state keys. ZeRO-Infinity's NVMe sub-groups
    keep the master and the Adam moments in the swap files the update did not overwrite
    (`OptimizerSwapper.spare_slot`); the record holds the rest (the step count, which lives in memory).
    """

    #: the name of the parameter's values in `elsewhere`
    VALUES = "\0values"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        param: torch.Tensor,
        group_index: int,
        spare: dict[str, torch.Tensor] | None = None,
        *,
        copy: bool = True,
        elsewhere: Collection[str] = (),
        hyper: dict[str, Any] | None = None,
    ) -> None:
        self.param = param
        #: whether the values and state were copied (else only the hyper-parameters are kept: no undo)
        self.restorable = copy
        self.elsewhere = frozenset(elsewhere)
        own_values = copy and self.VALUES not in self.elsewhere
        self.values = _copy_value(param, spare, self.VALUES) if own_values else None
        self.had_state = param in optimizer.state
        state = optimizer.state.get(param, {})
        self.state = {k: _copy_value(v, spare, k) for k, v in state.items() if k not in self.elsewhere} if copy else {}
        self.group_index = group_index
        #: the hyper-parameters the update used (`hyper`, else the group's now)
        self.hyper = hyper if hyper is not None else hyper_of(optimizer.param_groups[group_index])

    def hyper_changed(self, optimizer: torch.optim.Optimizer) -> bool:
        group = optimizer.param_groups[self.group_index]
        now = {k: v for k, v in group.items() if k != "params"}
        return now.keys() != self.hyper.keys() or any(not _same(now[k], self.hyper[k]) for k in now)

    def restore(self, optimizer: torch.optim.Optimizer) -> None:
        """Put back the values and the state exactly as they were (in place, so views stay valid)."""
        if not self.restorable:
            raise RuntimeError("speculative step: this update was made without an undo copy and cannot be undone")
        if self.VALUES not in self.elsewhere:
            assert self.values is not None
            with torch.no_grad():
                self.param.copy_(self.values)
        if not self.had_state:
            optimizer.state.pop(self.param, None)
            return
        live = optimizer.state[self.param]
        for key in list(live):
            if key not in self.state and key not in self.elsewhere:
                del live[key]
        for key, old in self.state.items():
            cur = live.get(key)
            if isinstance(old, torch.Tensor) and isinstance(cur, torch.Tensor) and cur.shape == old.shape:
                with torch.no_grad():
                    cur.copy_(old)
            else:  # the copy may be a reused buffer: the state gets its own tensor
                live[key] = old.clone() if isinstance(old, torch.Tensor) else old


class SpeculativeSteps:
    """Steps units of a base optimizer on a worker thread as their gradients complete; undoes them on demand.

    Args:
        optimizer: the base optimizer whose state the updates change.
        step_fn: `step_fn(key, grad, hyper)` updates the unit `key` with gradient `grad` and the group's
            hyper-parameters `hyper` as they were at `submit`; run on the worker, one unit at a time. It must
            not read the live param group: the caller's thread may change it meanwhile (an lr set between the
            backward and `step()`), and which value the update saw would then depend on timing.
        num_threads: intra-op threads of the worker (`torch.set_num_threads` in that thread; None: leave).
        keep_undo: copy what each update overwrites first (the default for `submit`). Without the copy
            an update cannot be undone, so only go without where the caller knows no step will be
            skipped, clipped or redone.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        step_fn: Callable[[Hashable, torch.Tensor, dict[str, Any]], None],
        *,
        num_threads: int | None = None,
        keep_undo: bool = True,
    ) -> None:
        self.optimizer = optimizer
        self.step_fn = step_fn
        self.keep_undo = keep_undo
        self.num_threads = num_threads
        self._pool: ThreadPoolExecutor | None = None
        self._futures: list[Future[None]] = []
        self._undo: dict[Hashable, UndoRecord] = {}
        self._spare: dict[Hashable, dict[str, torch.Tensor]] = {}  # per unit: the undo copies' buffers, reused
        self._lock = threading.Lock()
        #: keys updated since the last `settle`, in update order
        self.stepped: list[Hashable] = []

    def _worker(self) -> ThreadPoolExecutor:
        if self._pool is None:
            main_threads = torch.get_num_threads()
            init = None
            if self.num_threads is not None:
                n = self.num_threads

                def init() -> None:
                    torch.set_num_threads(n)

            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ds-speculative-step", initializer=init)
            # The initializer runs in the worker; torch also records the count process-wide, so restore the
            # caller's once the worker has set its own.
            self._pool.submit(lambda: None).result()
            torch.set_num_threads(main_threads)
        return self._pool

    def submit(
        self, key: Hashable, param: torch.Tensor, group_index: int, grad: torch.Tensor, *, keep_undo: bool | None = None
    ) -> None:
        """Update unit `key` (its optimizer parameter `param` in group `group_index`) with `grad`, soon;
        `keep_undo` overrides the constructor's choice for this update."""
        copy = self.keep_undo if keep_undo is None else keep_undo
        hyper = hyper_of(self.optimizer.param_groups[group_index])  # on the caller's thread: what "now" means

        def run() -> None:
            spare = self._spare.setdefault(key, {}) if copy else None
            record = UndoRecord(self.optimizer, param, group_index, spare, copy=copy, hyper=hyper)
            self.step_fn(key, grad, hyper)
            with self._lock:
                self._undo[key] = record
                self.stepped.append(key)

        self._futures.append(self._worker().submit(run))

    def wait(self) -> None:
        """Wait for every submitted update; a failure in the worker is raised here."""
        futures, self._futures = self._futures, []
        errors = [f.exception() for f in futures]
        for err in errors:
            if err is not None:
                raise err

    def restorable(self, key: Hashable) -> bool:
        """Whether the update of `key` can be undone (it was made with an undo copy)."""
        return key in self._undo and self._undo[key].restorable

    def changed_hyper(self) -> list[Hashable]:
        """Keys whose group's hyper-parameters changed since they were updated (after `wait`)."""
        return [k for k in self.stepped if k in self._undo and self._undo[k].hyper_changed(self.optimizer)]

    def undo(self, keys: Iterable[Hashable]) -> None:
        """Restore the units `keys` to before their update (after `wait`) and forget them."""
        keys = list(keys)
        missing = [k for k in keys if k not in self._undo]
        if missing:
            raise RuntimeError(f"speculative step: no undo record for {missing!r}")
        for key in keys:
            self._undo.pop(key).restore(self.optimizer)
        gone = set(keys)
        self.stepped = [k for k in self.stepped if k not in gone]

    def undo_all(self) -> None:
        self.undo(list(self.stepped))

    def commit(self) -> list[Hashable]:
        """Keep every update; returns their keys and forgets the undo records."""
        kept, self.stepped = self.stepped, []
        self._undo.clear()
        return kept

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
