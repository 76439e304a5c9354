"""Running a job's processes as one unit: start each in its own session, end whole trees, forward signals.

[Note: why no orphans] Each worker starts in a new session (its own process group), so the
terminal's Ctrl-C reaches only the supervisor, which forwards it; and a worker's children share
its group, so one `killpg` ends them. A child that moved to another session is still found by
walking the parent links in `/proc`. The supervisor marks itself a child subreaper, so processes
whose parent died are re-parented to it instead of init, and the final sweep finds them too. If
the supervisor itself is SIGKILLed, `PR_SET_PDEATHSIG` takes its direct children down with it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import IO, Any

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _libc() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:  # not Linux/glibc: no prctl, the process-group kills still work
        return None


def become_subreaper() -> bool:
    """Make orphaned descendants re-parent to this process (Linux); False where unsupported."""
    libc = _libc()
    return bool(libc is not None and hasattr(libc, "prctl") and libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)


def _child_setup(parent_pid: int, affinity: Sequence[int] | None) -> Callable[[], None]:
    """The pre-exec hook: die with the parent, and pin to `affinity` cores when given."""
    libc = _libc()
    prctl = getattr(libc, "prctl", None) if libc is not None else None

    def setup() -> None:
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
            if os.getppid() != parent_pid:  # the parent died before prctl took effect
                os._exit(1)
        if affinity:
            os.sched_setaffinity(0, affinity)

    return setup


def _process_table() -> dict[int, tuple[int, int, bool]]:
    """`{pid: (ppid, pgid, is_zombie)}` for every process visible in /proc."""
    table: dict[int, tuple[int, int, bool]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue  # it exited while we looked
        fields = data[data.rindex(b")") + 2 :].split()
        table[int(name)] = (int(fields[1]), int(fields[2]), fields[0] == b"Z")
    return table


def job_processes(roots: Iterable[int], pgids: Iterable[int], *, include_own_children: bool) -> set[int]:
    """Every live process of a job: descendants of `roots`, members of `pgids`, and (when this
    process is the job's dedicated supervisor) everything re-parented to it. Zombies are left out."""
    table = _process_table()
    me = os.getpid()
    groups = set(pgids)
    todo = [pid for pid, (_, pgid, _) in table.items() if pgid in groups]
    todo += [pid for pid in roots if pid in table]
    if include_own_children:
        todo += [pid for pid, (ppid, _, _) in table.items() if ppid == me]
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found: set[int] = set()
    while todo:
        pid = todo.pop()
        if pid in found:
            continue
        found.add(pid)
        todo += children.get(pid, [])
    return {pid for pid in found if pid != me and not table[pid][2]}


def _signal_all(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def exit_code(returncode: int) -> int:
    """A Popen return code as a shell exit status (killed by signal N: 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


@dataclass
class Managed:
    """One supervised process (a rank, or an ssh/pdsh/mpirun client)."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: str | None = None
    watcher: threading.Thread | None = None
    """The thread passing its stderr through `stderr_watch`, if any."""


class Supervisor:
    """Start processes, wait for all of them, and end the whole job on the first failure or a signal.

    Args:
        grace_s: seconds between SIGTERM and SIGKILL when ending the job.
        poll_s: how often exits are checked.
        on_terminate: called once when the job is being ended (e.g. remote kill commands).
        dedicated: this process exists only to run the job, so every process re-parented to it
            belongs to the job (true for `ds_launcher.launch` and the runner).
    """

    def __init__(
        self,
        *,
        grace_s: float = 5.0,
        poll_s: float = 0.05,
        on_terminate: Callable[[], None] | None = None,
        dedicated: bool = True,
    ) -> None:
        self.grace_s = grace_s
        self.poll_s = poll_s
        self.on_terminate = on_terminate
        self.dedicated = dedicated and become_subreaper()
        self.procs: list[Managed] = []
        self._signal: int | None = None
        self._failure: tuple[str, int] | None = None
        self._kill_deadline: float | None = None

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: dict[str, str],
        cwd: str | None = None,
        log_path: str | None = None,
        affinity: Sequence[int] | None = None,
        stdout: IO[bytes] | None = None,
        stderr_watch: Callable[[str], int | None] | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start `argv` in a new session; with `log_path`, stdout and stderr go to that file.

        With `stderr_watch`, the process's stderr is passed through line by line to this process's
        stderr, and a line for which `stderr_watch` returns a non-zero status fails the job with that
        status at once (pdsh reports each host's end this way, but exits only when all hosts ended).
        """
        out: IO[bytes] | None = stdout
        if log_path is not None:
            out = open(log_path, "ab")  # noqa: SIM115 - the child owns it; closed below once inherited
        err: int | None = subprocess.STDOUT if log_path else subprocess.PIPE if stderr_watch else None
        try:
            popen = subprocess.Popen(
                list(argv),
                env=env,
                cwd=cwd,
                stdout=out,
                stderr=err,
                start_new_session=True,
                preexec_fn=_child_setup(os.getpid(), affinity),
            )
        finally:
            if log_path is not None and out is not None:
                out.close()
        managed = Managed(name, popen, log_path)
        self.procs.append(managed)
        if stderr_watch is not None and popen.stderr is not None:
            managed.watcher = threading.Thread(
                target=self._watch, args=(name, popen.stderr, stderr_watch), daemon=True, name=f"stderr of {name}"
            )
            managed.watcher.start()
        logger.debug("started %s: pid %d", name, popen.pid)
        return popen

    def fail(self, name: str, status: int) -> None:
        """End the job with `status` (from any thread): as if the process `name` had exited with it."""
        if self._failure is None:
            self._failure = (name, status)

    def _watch(self, name: str, stream: IO[bytes], watch: Callable[[str], int | None]) -> None:
        sink = sys.stderr.buffer if hasattr(sys.stderr, "buffer") else None
        for raw in iter(stream.readline, b""):
            if sink is not None:
                sink.write(raw)
                sink.flush()
            status = watch(raw.decode(errors="replace"))
            if status:
                self.fail(f"{name}: {raw.decode(errors='replace').strip()}", status)
        stream.close()

    def run(self) -> int:
        """Wait for every process; return the job's exit status.

        0 when all exit 0; the first non-zero exit (128 + N for a death by signal N), after the
        others were terminated; 128 + N when this process got SIGINT/SIGTERM/SIGHUP N, which is
        forwarded to every process. No process of the job survives this call.
        """
        previous = self._install_handlers()
        status = 0
        try:
            status = self._wait()
        finally:
            self._sweep()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return status

    def abort(self) -> None:
        """Kill everything started so far (a later process could not be started)."""
        self._kill(signal.SIGKILL)
        self._sweep()

    def _install_handlers(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous: dict[int, Any] = {}

        def handler(signum: int, _frame: object) -> None:
            if self._signal is not None:  # a second Ctrl-C: stop waiting politely
                self._kill_deadline = 0.0
            self._signal = signum

        for sig in _FORWARDED:
            previous[sig] = signal.signal(sig, handler)
        return previous

    def _wait(self) -> int:
        status: int | None = None
        signalled = False
        while True:
            if self._signal is not None and not signalled:
                signalled = True
                logger.warning(
                    "got %s: forwarding it to %d process(es)",
                    signal.Signals(self._signal).name,
                    sum(m.popen.poll() is None for m in self.procs),
                )
                if status is None:
                    status = 128 + self._signal
                self._terminate(self._signal)
            if self._failure is not None and status is None:
                what, status = self._failure
                logger.error(
                    "%s; stopping the other %d process(es)", what, sum(m.popen.poll() is None for m in self.procs)
                )
                self._terminate(signal.SIGTERM)
            running, watched_failure = 0, False
            for m in self.procs:
                rc = m.popen.poll()
                if rc is not None and m.watcher is not None:
                    # Its last lines first: they may say why it failed, with a better status than its own.
                    m.watcher.join(timeout=2.0)
                    m.watcher = None
                    if self._failure is not None and status is None:
                        watched_failure = True  # handled at the top of the loop
                        break
                if rc is None:
                    running += 1
                elif rc != 0 and status is None:
                    status = exit_code(rc)
                    self._report_failure(m, rc)
                    self._terminate(signal.SIGTERM)
            if watched_failure:
                continue
            if running == 0:
                return status or 0
            if self._kill_deadline is not None and time.monotonic() >= self._kill_deadline:
                logger.warning("%d process(es) still running %.0fs after SIGTERM: killing", running, self.grace_s)
                self._kill(signal.SIGKILL)
                self._kill_deadline = float("inf")
            time.sleep(self.poll_s)

    def _report_failure(self, m: Managed, rc: int) -> None:
        how = f"was killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
        others = sum(p.popen.poll() is None for p in self.procs)
        logger.error("%s (pid %d) %s; stopping the other %d process(es)", m.name, m.popen.pid, how, others)
        if m.log_path:
            try:
                with open(m.log_path, encoding="utf-8", errors="replace") as f:
                    tail = "".join(f.readlines()[-30:])
                logger.error("last lines of %s:\n%s", m.log_path, tail)
            except OSError:
                pass

    def _job(self) -> set[int]:
        # A worker's pid is also its process-group id (each starts a new session). The kernel does not
        # reuse a pid while a group by that id has members, so groups are safe to name after a
        # worker was reaped; its pid as a tree root is only used while it is unreaped.
        roots = [m.popen.pid for m in self.procs if m.popen.returncode is None]
        pgids = [m.popen.pid for m in self.procs]
        return job_processes(roots, pgids, include_own_children=self.dedicated)

    def _kill(self, sig: int) -> None:
        _signal_all(self._job(), sig)

    def _terminate(self, sig: int) -> None:
        if self._kill_deadline is None:
            self._kill_deadline = time.monotonic() + self.grace_s
            if self.on_terminate is not None:
                try:
                    self.on_terminate()
                except Exception:  # noqa: BLE001 - a failing remote kill must not stop the local one
                    logger.exception("remote termination failed")
        self._kill(sig)

    def _sweep(self) -> None:
        """SIGKILL whatever is left of the job and reap it, so nothing outlives the supervisor."""
        deadline = time.monotonic() + 5.0
        while True:
            left = self._job()
            managed = {m.popen.pid for m in self.procs}
            for m in self.procs:
                if m.popen.poll() is None:
                    left.add(m.popen.pid)
            if left:
                logger.debug("sweeping %d leftover process(es): %s", len(left), sorted(left))
                _signal_all(left, signal.SIGKILL)
            self._reap_orphans(managed)
            if not left or time.monotonic() > deadline:
                return
            time.sleep(0.02)

    def _reap_orphans(self, managed: set[int]) -> None:
        if not self.dedicated:
            return
        me = os.getpid()
        for pid, (ppid, _, _) in _process_table().items():
            if ppid == me and pid not in managed:
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass
        for m in self.procs:
            m.popen.poll()
