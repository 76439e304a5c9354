"""`OverlappedCpuUpdate`: ZenFlow's CPU update in a worker process, overlapped with the next micro steps.

`zero_optimization.zenflow.overlap_step: true`. The host masters, two sets of gradient accumulators and
the place the result goes (`ds_zero._zenflow.results`) live in shared memory; a worker process (spawned
once, at the first update) owns the Adam moments and runs the CPU optimizer (`ds_ops.ZenFlowCPUAdam`) on
command, on its own share of the rank's cores (`pt_reserved_cores_perc` stays with training). The
training process sends a command per update window and goes on with forward and backward while the
worker computes.

The gradients are handed over without a copy: the ZeRO optimizer accumulates a window straight into one
of the two shared sets (its accumulator list is pointed at it), the command names that set, and the list
is pointed at the other set for the next window; the worker clears a set when its step is done with it.
On a CPU host a copy of the window's gradients costs about as much memory traffic as the update it hands
over, so copying them would keep most of the update's time in the step.

DeepSpeed 0.19.8's semantics, kept here:

- the windows alternate between two sets of Adam moments, by window parity (`(m // update_interval) % 2`;
  `m % 2` in warm-up), and between two gradient buffers (here: the two accumulator sets);
- in warm-up the update is applied at once (submitted, waited for, put into the model);
- after warm-up, a window's update is submitted at its end and its result is put into the model at the
  end of the next window, before that window is submitted: the model sees each CPU update one window late.
  The first window after warm-up (and, without warm-up, also the very first) applies nothing;
- at a reselection the masters are reset from the model's weights.

Where DeepSpeed lets the worker race with the model (it resets the masters at a reselection while its
worker may still be updating them, so its result depends on the worker's speed), ds waits for the worker
first, which is DeepSpeed's result whenever its worker keeps up (ds-engine's ZenFlow tests compare with
DeepSpeed recorded that way).

Why a process, not a thread: the update is memory-bandwidth bound Python-free C++ either way, but a
process gets its own OpenMP pool pinned to its cores and its own allocator, so it does not contend with
the training process's intra-op threads, as in DeepSpeed.
"""

from __future__ import annotations

import io
import logging
import math
import multiprocessing as mp
import os
from collections.abc import Callable
from typing import Any

import torch

from ds_zero._host_buffers import release_pinned
from ds_zero._stage12.flat_buffer import FlatParamGroup
from ds_zero._zenflow.results import result_slots

logger = logging.getLogger(__name__)

__all__ = ["OverlappedCpuUpdate", "split_cores"]

#: Seconds between checks that the worker is alive while waiting for it.
_POLL_S = 5.0
_HYPER = ("lr", "betas", "eps", "weight_decay", "bias_correction")


def split_cores(cores: list[int], reserved_perc: float) -> tuple[list[int], list[int]]:
    """(worker cores, training cores): training keeps the first `ceil(reserved_perc * n)`; both share all
    cores when that leaves either side empty (DeepSpeed's rule)."""
    keep = math.ceil(reserved_perc * len(cores))
    if 0 < keep < len(cores):
        return cores[keep:], cores[:keep]
    return list(cores), list(cores)


def _worker_main(conn: Any, params: list[torch.Tensor], grads: list[list[torch.Tensor]],
                 results: list[list[torch.Tensor]], sets: list[list[torch.Tensor]], adamw_mode: bool,
                 cores: list[int]) -> None:  # fmt: skip
    """The worker: two optimizers (one per window parity) over the shared masters; one command at a time.

    `grads[i][k]` is master i's gradient in accumulator set k (a view of `sets[k]`), cleared after use;
    `results[i][j]` is where master i's result goes when the command names slot j."""
    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(max(1, len(cores)))
    from ds_ops import ZenFlowCPUAdam

    optimizers = [ZenFlowCPUAdam([{"params": [p]} for p in params], adamw_mode=adamw_mode) for _ in range(2)]
    conn.send("ready")
    while True:
        command = conn.recv()
        if command[0] == "exit":
            break
        if command[0] == "state":  # for a checkpoint: both optimizers' state, serialized (no shared storage)
            buffer = io.BytesIO()
            torch.save([opt.state_dict() for opt in optimizers], buffer)
            conn.send(("state", buffer.getvalue()))
            continue
        if command[0] == "load":
            for opt, saved in zip(optimizers, torch.load(io.BytesIO(command[1]), weights_only=True), strict=True):
                opt.load_state_dict(saved)
            conn.send("loaded")
            continue
        _, state, accumulated, slot, step_id, hypers = command
        opt = optimizers[state]
        for group, hyper, param, grad in zip(opt.param_groups, hypers, params, grads, strict=True):
            group.update(hyper)
            param.grad = grad[accumulated]
        opt.step(step_id=step_id)
        for param, result in zip(params, results, strict=True):
            param.grad = None
            result[slot].copy_(param)
        for buffer in sets[accumulated]:  # cleared before "done": the training process may fill it next
            buffer.zero_()
        conn.send("done")
    conn.close()


class OverlappedCpuUpdate:
    """The CPU update run by a worker process (see the module note).

    Args:
        optimizer: the training process's CPU optimizer: its param groups give the hyper-parameters of
            each update (its own state is not used: the moments live in the worker).
        flats: the flat parameter groups.
        masters: the host fp32 master partitions (moved to shared memory here).
        updater: the ZeRO optimizer's partition updater.
        schedule: the resolved ZenFlow schedule.
        reserved_perc: `pt_reserved_cores_perc`.
        accumulators: the ZeRO optimizer's list of host gradient accumulators, which it adds each micro step
            into; its entries are replaced here by shared ones (the list object stays, so every holder of it
            sees the swaps).
        master_gradients: maps a set of accumulators to each master's gradient in it (views).
        master_groups: the param group of `optimizer` each master belongs to (None: master i is group i's
            only one, as at stage 1/2; at stage 3 a group may have several tiles).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, flats: list[FlatParamGroup], masters: list[torch.Tensor],
                 updater: Any, schedule: Any, reserved_perc: float, accumulators: list[torch.Tensor],
                 master_gradients: Callable[[list[torch.Tensor]], list[torch.Tensor]],
                 master_groups: list[int] | None = None) -> None:  # fmt: skip
        self.optimizer = optimizer
        self.flats = flats
        self.masters = [m.share_memory_() for m in masters]
        self.updater = updater
        self.schedule = schedule
        self.reserved_perc = reserved_perc
        self.master_groups = list(range(len(masters))) if master_groups is None else list(master_groups)
        self.accumulators = accumulators
        #: the two shared accumulator sets; the ZeRO optimizer fills `sets[self._filling]`
        self.sets = [[torch.zeros_like(acc).share_memory_() for acc in accumulators] for _ in range(2)]
        by_set = [master_gradients(one) for one in self.sets]
        #: `grads[i][k]`: master i's gradient in set k
        self.grads = [list(pair) for pair in zip(*by_set, strict=True)]
        self._filling = 0
        for k, value in enumerate(accumulators):
            self.sets[0][k].copy_(value)
        release_pinned(accumulators)
        accumulators[:] = self.sets[0]
        self.results = result_slots(flats, self.masters)
        self._process: Any = None
        self._conn: Any = None
        self._outstanding = 0
        self._first_after_warm_up = True
        #: a submitted window's result waits in `results` (put into the model at the next window's end)
        self._has_result = False
        #: the worker optimizers' state from a checkpoint, handed to the worker when it starts
        self._restored: bytes | None = None

    # -- the worker -------------------------------------------------------------------------------
    def _start(self) -> None:
        if mp.current_process().daemon:
            raise RuntimeError(
                "zero_optimization.zenflow.overlap_step=true runs the CPU update in a worker process, which this "
                "rank cannot start: it is a daemonic process (e.g. a multiprocessing pool or harness child); "
                "launch ranks with the deepspeed launcher or torchrun, or set overlap_step false"
            )
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        worker_cores, _training = split_cores(cores, self.reserved_perc)
        ctx = mp.get_context("spawn")
        here, there = ctx.Pipe()
        adamw = bool(getattr(self.optimizer, "adam_w_mode", True))
        self._process = ctx.Process(
            target=_worker_main,
            args=(there, self.masters, self.grads, self.results.slots(), self.sets, adamw, worker_cores),
            daemon=True,
            name="zenflow-cpu-update",
        )
        self._process.start()
        there.close()
        self._conn = here
        self._receive("ready")
        if self._restored is not None:
            self._conn.send(("load", self._restored))
            self._receive("loaded")
            self._restored = None
        logger.info("ZenFlow: CPU update worker pid %d on cores %s", self._process.pid, worker_cores)

    def _receive(self, expected: str) -> Any:
        while not self._conn.poll(_POLL_S):
            if not self._process.is_alive():
                raise RuntimeError(
                    f"the ZenFlow CPU update worker (pid {self._process.pid}) exited with code "
                    f"{self._process.exitcode} instead of answering; see its traceback above"
                )
        got = self._conn.recv()
        if (got[0] if isinstance(got, tuple) else got) != expected:
            raise RuntimeError(f"the ZenFlow CPU update worker answered {got!r}, expected {expected!r}")
        return got

    def wait(self) -> None:
        """Block until every submitted update is done."""
        while self._outstanding:
            self._receive("done")
            self._outstanding -= 1

    def submit(self, grads: list[torch.Tensor], *, state: int, step_id: int) -> None:
        """Hand the window's gradients to the worker (Adam moments `state`) and return at once.

        `grads` are normally views of the set being filled, handed over as they are; any that is not (a
        caller that replaced an accumulator) is copied into it first. The accumulators then point at the
        other set, which the worker cleared when it was done with it."""
        if self._process is None:
            self._start()
        self.wait()  # one update in flight: the other set is free and cleared
        filled = self._filling
        for pair, grad in zip(self.grads, grads, strict=True):
            target = pair[filled]
            if grad.data_ptr() != target.data_ptr() or grad.shape != target.shape:
                target.copy_(grad)
        groups = self.optimizer.param_groups
        hypers = [{k: groups[i][k] for k in _HYPER if k in groups[i]} for i in self.master_groups]
        self._conn.send(("step", state, filled, self.results.writes_next, step_id, hypers))
        self._outstanding += 1
        self._has_result = True
        self._filling = 1 - filled
        self.accumulators[:] = self.sets[self._filling]

    # -- checkpoints ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What resumes the overlap exactly: both worker optimizers' state (after the update in flight
        finished: a save waits for it), the masters as they are, the pending result (`stale`) and where the
        delay stands. (The masters' copies of the selected columns are read here: the window in flight at a
        reselection was computed from them and lands after it, so they are saved raw, not from the model.)"""
        self.wait()
        if self._process is not None:
            self._conn.send(("state",))
            worker: bytes | None = self._receive("state")[1]
        else:
            worker = self._restored
        return {
            "worker_optimizers": worker,
            "masters": [m.clone() for m in self.masters],
            "stale": [s.clone() for s in self.results.pending()],
            "has_result": self._has_result,
            "first_after_warm_up": self._first_after_warm_up,
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restore `state_dict()`'s; the worker gets its optimizers' state now or when it starts."""
        self.wait()
        for stale, value in zip(self.results.pending(), saved["stale"], strict=True):
            stale.copy_(value)
        for master, value in zip(self.masters, saved["masters"], strict=True):
            master.copy_(value)
        self._has_result = bool(saved["has_result"])
        self._first_after_warm_up = bool(saved["first_after_warm_up"])
        self._restored = saved["worker_optimizers"]
        if self._process is not None and self._restored is not None:
            self._conn.send(("load", self._restored))
            self._receive("loaded")
            self._restored = None

    # -- ZenFlow's step -----------------------------------------------------------------------------
    def refresh_masters(self) -> None:
        """Reset the masters from the model's partitions (after the worker is done with them)."""
        self.wait()
        self.updater.refresh_masters()

    def update(self, grads: list[torch.Tensor], *, step_id: int, sync: Callable[[], None]) -> bool:
        """DeepSpeed's order at micro step `step_id - 1`: warm-up submits first; then the previous result is
        copied in (see the module note); after warm-up this window is submitted last.

        Returns True: the accumulators now point at a cleared set (the caller need not clear them)."""
        m = step_id - 1
        s = self.schedule
        state = s.overlap_state(m)
        if m < s.full_warm_up_rounds:
            self.submit(grads, state=state, step_id=step_id)
        self._copy_result(m, sync)
        if m >= s.full_warm_up_rounds:
            self.submit(grads, state=state, step_id=step_id)
        return True

    def _copy_result(self, m: int, sync: Callable[[], None]) -> None:
        if not self._has_result:
            return
        if m + 1 > self.schedule.full_warm_up_rounds and self._first_after_warm_up:
            self._first_after_warm_up = False
            return
        self.wait()
        self.results.apply()
        sync()

    def close(self) -> None:
        """Stop the worker (the last submitted update is not applied, as in DeepSpeed)."""
        if self._process is None:
            return
        try:
            if self._process.is_alive():
                self._conn.send(("exit",))
            self._process.join(timeout=30)
        finally:
            if self._process.is_alive():
                self._process.terminate()
            self._conn.close()
            self._process = None
