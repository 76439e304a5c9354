"""Destroy the process groups at interpreter exit, while gloo's worker threads can still take the GIL.

Why: gloo runs every collective on a worker thread that holds the tensors until just after the caller's
`wait()` returns. When the caller has already dropped its own reference (a temporary such as the 1-element
overflow flag or a partial gradient norm), the worker frees the tensor's Python object and needs the GIL
to do so. If the script has ended meanwhile, CPython is finalizing: it ends that thread with
`pthread_exit` inside a `noexcept` C++ destructor and the process dies of SIGABRT ("terminate called without
an active exception") after a run that succeeded. DeepSpeed-style scripts never call
`destroy_process_group`, so ds does it for them from an `atexit` hook: destroying the groups joins the
workers while the interpreter is still whole. (Seen in CI; here, 6 of 38 2-rank launches of a finished
script died of SIGABRT, and with torch alone 2 of 30 runs of a 2-rank loop ending in an all-reduce.)

After an uncaught exception too, since the groups would otherwise meet the same end during
finalization (seen in CI: a rank that raised died of SIGABRT, status 134 instead of Python's 1). There a
collective may still be in flight, and destroying would wait for peers that are not coming, so that
teardown gets a short limit (`EXCEPTION_TEARDOWN_LIMIT_S`): a launcher must learn of the failure within
seconds to stop the job. A watchdog bounds every teardown (an async collective that nobody waited on).
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import logging
import os
import sys
import threading
from collections.abc import Callable

import torch.distributed as dist

logger = logging.getLogger(__name__)

TEARDOWN_LIMIT_S = 60.0
"""How long destroying the groups at exit may take before the process exits without them (status 1)."""

EXCEPTION_TEARDOWN_LIMIT_S = 5.0
"""The same limit after an uncaught exception, when the job is failing and peers may never come."""

_registered = False


def register_exit_teardown() -> None:
    """Arrange for `destroy_process_group()` at normal interpreter exit (once per process; idempotent)."""
    global _registered
    if not _registered:
        atexit.register(_destroy_at_exit)
        _registered = True


def _ended_by_exception() -> bool:
    """Whether the main script is exiting because of an uncaught exception (CPython records it first)."""
    return getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None


def _destroy_at_exit() -> None:
    failed = _ended_by_exception()
    cancel = _start_watchdog(EXCEPTION_TEARDOWN_LIMIT_S if failed else TEARDOWN_LIMIT_S, failed)
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
        collect_unreachable_groups()
    except Exception as exc:  # noqa: BLE001 - a failed teardown must not mask how the script ended
        logger.warning("destroying the process groups at exit failed: %s", exc)
    finally:
        cancel()


def collect_unreachable_groups() -> None:
    """Free process groups that only a reference cycle still holds, now rather than at interpreter exit.

    [Note: groups in a cycle] `destroy_process_group` drops torch's references, but a group that is
    still part of a reference cycle lives on until the garbage collector runs, and the last collection
    is during interpreter finalization: its destructor then joins gloo's worker threads while they may
    still need the GIL, and the process dies of SIGABRT after a finished run (a core of such a rank:
    the main thread in `PyGC_Collect` under `Py_FinalizeEx`, two `ProcessGroupGloo::runLoop` threads
    alive, a third unwinding in `std::terminate`). One collection while the interpreter is whole frees
    it in time, also for a script that destroyed its groups itself.
    """
    gc.collect()


def _start_watchdog(limit_s: float, failed: bool) -> Callable[[], None]:
    """Arm the limit; returns its cancel. A thread where Python allows one at exit, else faulthandler.

    Python 3.12 refuses new threads once shutdown began ("can't create new thread at interpreter
    shutdown"); faulthandler's C watchdog still works there: it prints the stacks (ours names
    `_destroy_at_exit`) and exits with status 1.
    """
    watchdog = threading.Timer(limit_s, _give_up, args=(limit_s, failed))
    watchdog.daemon = True
    try:
        watchdog.start()
    except RuntimeError:
        faulthandler.dump_traceback_later(limit_s, exit=True)
        return faulthandler.cancel_dump_traceback_later
    return watchdog.cancel


def _give_up(limit_s: float, failed: bool) -> None:
    ending = "the script raised (its traceback is above); " if failed else ""
    sys.stderr.write(
        f"[ds_comm] {ending}destroying the process groups at exit took over {limit_s:g} s: a "
        "collective is still in flight (an async_op=True handle nobody waited on?). Exiting "
        "without the teardown, status 1.\n"
    )
    sys.stderr.flush()
    os._exit(1)
