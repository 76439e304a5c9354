"""Multi-process test harness: run a function on N ranks (spawned, gloo, free port) with a hang timeout.

Every package tests its distributed code through `run_ranks`:

    def _step(rank: int, world_size: int, lr: float) -> torch.Tensor:   # module level, so it pickles
        ...
        return flat_params

    results = run_ranks(2, _step, lr=0.1, timeout_s=60)                  # one result per rank

A rank that raises has its exception re-raised in the caller, with the rank's traceback as its
cause and a note naming the rank; the other ranks are killed. A job that outlives `timeout_s`
is killed whole and raises `RankTimeoutError`, after each rank printed its stacks to stderr.
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ds_comm import _atomic_file
from ds_comm._launch_env import free_port

__all__ = [
    "RankFailedError",
    "RankTimeoutError",
    "RemoteTraceback",
    "file_events",
    "free_port",
    "import_side_effects",
    "preload_in_ranks",
    "run_ranks",
]

_PRELOAD_ENV = "DS_TESTING_PRELOAD"  # read by `_forkserver_preload`, in the forkserver


class RankFailedError(RuntimeError):
    """A rank died without reporting (a crash, `os._exit`), or raised something that cannot be pickled."""


class RankTimeoutError(TimeoutError):
    """The ranks did not all finish within the harness timeout."""


class RemoteTraceback(Exception):
    """Carries a rank's formatted traceback as the `__cause__` of the re-raised exception."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _child(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    results: Any,
    env: dict[str, str],
    backend: str,
    num_threads: int,
    collective_timeout_s: float,
    dump_after_s: float,
) -> None:
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        # The parent hosts the rendezvous store; every rank connects to it as a client.
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    torch.set_num_threads(num_threads)
    faulthandler.dump_traceback_later(dump_after_s, exit=False)
    from ds_comm._dist_init import destroy_process_group, init_distributed

    try:
        init_distributed(dist_backend=backend, verbose=False, timeout=timedelta(seconds=collective_timeout_s))
        value = fn(rank, world_size, *args, **kwargs)
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException as exc:  # noqa: BLE001 - everything must reach the parent
        text = traceback.format_exc()
        try:
            payload = pickle.dumps(exc)
        except Exception:  # noqa: BLE001 - an unpicklable exception still reports its text
            payload = b""
        results.put((rank, "error", (type(exc).__name__, text, payload)))
    finally:
        faulthandler.cancel_dump_traceback_later()
        try:
            destroy_process_group()
        except Exception:  # noqa: BLE001 - teardown after a failure may fail too
            pass


def _kill(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)


def _raise_rank_error(rank: int, info: tuple[str, str, bytes]) -> None:
    name, text, payload = info
    exc: BaseException | None = None
    if payload:
        try:
            exc = pickle.loads(payload)
        except Exception:  # noqa: BLE001
            exc = None
    if exc is None:
        raise RankFailedError(f"rank {rank} raised {name}:\n{text}")
    exc.add_note(f"(raised on rank {rank}; its traceback is the cause above)")
    raise exc from RemoteTraceback(f"\n--- rank {rank} ---\n{text}")


def _context() -> Any:
    """A forkserver context whose server imported torch once, so each rank starts in milliseconds.

    [Note: why forkserver] `spawn` re-imports torch in every rank (seconds each, and 4 ranks on 2
    cores add up); plain `fork` from a test process that already ran torch ops can deadlock in
    OpenMP. The forkserver is a fresh process that imported torch but ran nothing, so forking it is
    both fast and safe. Each rank still receives the caller's sys.path, so test modules import.
    The server freezes what it imported (`_forkserver_preload`), so no rank's garbage collector walks it.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["ds_comm._forkserver_preload"])
    return ctx


def preload_in_ranks(*modules: str) -> None:
    """Have every rank of `run_ranks` start with `modules` already imported (a suite's conftest calls it).

    The ranks are forks of one server process (see [Note: why forkserver]); the server imports these
    before it forks, so a rank does not import the stack under test again (see [Note: preloading a
    suite's modules] in `_forkserver_preload`). Missing modules are skipped. Call it before the first
    `run_ranks` of the process: the server reads the list once, when that call starts it.
    """
    names = [n for n in os.environ.get(_PRELOAD_ENV, "").split(",") if n]
    names += [m for m in modules if m not in names]
    os.environ[_PRELOAD_ENV] = ",".join(names)


def run_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout_s: float = 60.0,
    backend: str = "gloo",
    num_threads: int = 1,
    env: dict[str, str] | None = None,
    collective_timeout_s: float | None = None,
    daemonic: bool = True,
    **kwargs: Any,
) -> list[Any]:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` fresh processes; return per-rank results.

    Args:
        world_size: number of ranks.
        fn: a module-level function (it is pickled by reference into spawned processes).
        timeout_s: the whole job's deadline in seconds; past it every rank is killed.
        backend: process-group backend ("gloo" on CPU).
        num_threads: `torch.set_num_threads` in each rank (1 keeps 4 ranks on 2 cores sane).
        env: extra environment variables for the ranks.
        collective_timeout_s: each collective's timeout inside the ranks; default half of `timeout_s`,
            so a hung collective fails with the op's name before the harness kills the job.
        daemonic: start the ranks as daemonic processes (they die with the parent). False lets a rank
            start processes of its own (ZenFlow's `overlap_step` worker, which Python refuses to a
            daemonic process); the harness still kills every rank when the job ends or its deadline passes.

    Returns:
        `[result of rank 0, result of rank 1, ...]`; results travel through `torch.save`.

    Raises:
        The first failing rank's exception (its traceback as `__cause__`), `RankFailedError` for a rank
        that died silently, `RankTimeoutError` when the deadline passes.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _context()
    results = ctx.Queue()
    # [Note: rendezvous] The parent hosts the TCPStore on a port the OS picks while binding, so no
    # other process can take it between choosing and binding (a free_port() race seen on busy hosts).
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=max(timeout_s, 30.0)),
    )
    port = store.port
    coll_timeout = collective_timeout_s if collective_timeout_s is not None else max(5.0, timeout_s / 2)
    procs = [
        ctx.Process(
            target=_child,
            args=(
                rank,
                world_size,
                port,
                fn,
                args,
                kwargs,
                results,
                dict(env or {}),
                backend,
                num_threads,
                coll_timeout,
                max(1.0, timeout_s - 2),
            ),
            daemon=daemonic,
            name=f"ds-rank-{rank}",
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    outputs: dict[int, bytes] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(outputs) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pending = sorted(set(range(world_size)) - set(outputs))
                raise RankTimeoutError(
                    f"ranks {pending} of {world_size} did not finish within {timeout_s}s (stacks were dumped to stderr)"
                )
            try:
                rank, status, payload = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                for rank, p in enumerate(procs):
                    if rank not in outputs and p.exitcode not in (None, 0):
                        # Give a dying rank's queued report a moment to arrive before calling it silent.
                        try:
                            rank2, status, payload = results.get(timeout=1.0)
                        except queue.Empty:
                            raise RankFailedError(
                                f"rank {rank} exited with code {p.exitcode} without reporting"
                            ) from None
                        if status == "error":
                            _raise_rank_error(rank2, payload)
                        outputs[rank2] = payload
                continue
            if status == "error":
                _raise_rank_error(rank, payload)
            outputs[rank] = payload
        for p in procs:
            p.join(timeout=10)
    finally:
        _kill(procs)
        results.close()
        del store
    return [torch.load(io.BytesIO(outputs[r]), weights_only=False) for r in range(world_size)]


def import_side_effects(module: str) -> dict[str, Any]:
    """Import `module` in a fresh interpreter and report what that import did.

    Returns a dict with `ds_modules` (top-level `ds_*` packages now loaded), `cuda_initialized`
    (whether the import touched CUDA), `pydantic_loaded` (the config models' dependency, ~0.3 s
    to import, which packages load only when a config is read), `new_modules` (every module the
    import loaded beyond `import torch`, sorted: what a test can hold to a list, unlike a timing) and
    `seconds` (import time beyond `import torch`).
    Used by every package's "importing has no side effects" test.
    """
    import json
    import subprocess
    import sys

    code = (
        "import json, sys, time, torch\n"
        "before = set(sys.modules)\n"
        "t = time.perf_counter()\n"
        f"import {module}\n"
        "dt = time.perf_counter() - t\n"
        "new = sorted(set(sys.modules) - before)\n"
        "mods = sorted({m.split('.')[0] for m in sys.modules if m.startswith('ds_')})\n"
        "print(json.dumps({'ds_modules': mods, 'cuda_initialized': torch.cuda.is_initialized(), 'seconds': dt,"
        " 'pydantic_loaded': 'pydantic' in sys.modules, 'new_modules': new}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"importing {module} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def file_events(hook: Callable[[str, Path], None]) -> Iterator[None]:
    """Call `hook(event, path)` at every step of every `ds_comm.atomic_write` in this process (fault injection).

    Events, each before its step: `open`, `write`, `fsync`, `replace`, `fsync_dir` (see
    `ds_comm._atomic_file`); `path` is the final file. A hook that kills the process there leaves the
    file system exactly as a crash at that point would. Not re-entrant; the previous hook is restored.
    """
    previous = _atomic_file._hook
    _atomic_file._hook = hook
    try:
        yield
    finally:
        _atomic_file._hook = previous
