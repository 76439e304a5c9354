"""Run one group of DeepSpeed's unit tests under a supervisor that enforces each test's time limit from outside.

[Note: why a supervisor] DeepSpeed's harness (`tests/unit/common.py`) runs a test's ranks in a
`multiprocessing` pool and waits on the result with its own timeout (`DS_UNITTEST_TIMEOUT`, 600 s), after which
it ends the *whole* session with `pytest.exit`. A rank that raises a `BaseException` (`pytest.fail`, a failing
`pytest.raises` in the test body) kills its pool worker without a result, and the wait goes on. pytest-timeout's
signal method does not end that wait: SIGALRM lands on one of the pool's helper threads, Python only sets a flag,
and the main thread, blocked in the pool's timed lock wait, runs the handler when the wait returns (seen on
`ops/adam/test_cpu_adam.py::TestCPUAdamGPUError` with `--timeout=10`: SIGALRM caught, nothing pending, no
timeout reported after 60 s). The thread method would `os._exit` the whole process and lose every result after
it. So the limit is enforced twice:

1. in process, pytest-timeout (`--timeout`, SIGALRM): the test fails as `Timeout` with its stack when the
   process can recover;
2. from outside: a plugin (tools/_dsunit_plugin/dsunit_events.py) writes each test's start and result to a
   file as it happens; a test still running `grace` seconds after its limit is killed with its whole session
   (pool workers, forkserver and JIT builds included), recorded as `timeout`, and pytest starts again, deselecting
   every test that already has a result. A session that ends mid-test (pytest.exit, a crash) records that test
   as `crashed` and goes on the same way.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from pathlib import Path

from _dsunit_report import Outcome, Progress

logger = logging.getLogger(__name__)

PLUGIN_DIR = Path(__file__).resolve().parent / "_dsunit_plugin"


def pytest_command(python: Path, group: str, limit_s: int, exclude: str) -> list[str]:
    """The pytest command line for `unit/<group>` with the events plugin and pytest-timeout's signal method."""
    return [
        str(python),
        "-m",
        "pytest",
        f"unit/{group}",
        "-p",
        "no:cacheprovider",
        "-p",
        "dsunit_events",
        "--continue-on-collection-errors",
        f"--timeout={limit_s}",
        "--timeout-method=signal",
        *(["-k", f"not ({exclude})"] if exclude else []),
    ]


def _session_members(sid: int) -> list[int]:
    """The processes of session `sid` (from /proc: field 6 of each `stat`)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[3]) == sid:
            members.append(int(stat.parent.name))
    return members


def _kill_session(proc: subprocess.Popen[bytes]) -> None:
    """Kill pytest and everything it started. By session, not process group: ninja runs each compiler in a
    process group of its own, so a group kill would leave a JIT build running."""
    for _ in range(10):  # processes may fork while they are being killed
        members = _session_members(proc.pid)
        if not members:
            break
        for pid in members:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.wait()
        time.sleep(0.1)
    proc.wait()


def _read_new(path: Path, offset: int, progress: Progress) -> int:
    """Feed `progress` the complete lines written since `offset`; returns the new offset."""
    if not path.exists():
        return offset
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1
    for line in data[:end].decode("utf-8", "replace").splitlines():
        progress.feed(line)
    return offset + end


def run_group(
    python: Path,
    tests: Path,
    group: str,
    work: Path,
    env: dict[str, str],
    *,
    limit_s: int,
    grace_s: int = 60,
    exclude: str = "",
    poll_s: float = 1.0,
    extensions_dir: Path | None = None,
    resume: bool = False,
) -> dict[str, Outcome]:
    """Every test of `unit/<group>` run, each within `limit_s` (+ `grace_s` before the outside kill).

    The pytest output of every attempt goes to `<work>/<group>.log`, the event stream to `<group>.jsonl`.
    `extensions_dir`: the run's own `TORCH_EXTENSIONS_DIR`. A test killed while it JIT-builds an op leaves
    torch's build lock file behind, and every later load of that op would wait on it forever; nothing else
    uses this folder, so after a kill every lock in it is stale and is removed.
    `resume`: keep the results an earlier (interrupted) run of this group wrote in `work` and run only the
    tests without one, or whose result was a timeout or a crash.
    """
    slug = group.replace("/", "__").replace(":", "_")
    events, done, log_path = work / f"{slug}.jsonl", work / f"{slug}.done", work / f"{slug}.log"
    work.mkdir(parents=True, exist_ok=True)
    progress, offset, ended_before = Progress(), 0, set()
    if resume and events.exists():
        offset = _read_new(events, 0, progress)
        progress.running = None  # the test a killed run was in: run again, as every test without a result
        for test in [t for t, r in progress.outcomes.items() if r["outcome"] in ("timeout", "crashed")]:
            del progress.outcomes[test]  # and those that timed out: the reason may be gone (a build, the load)
    else:
        for path in (events, done, log_path):
            path.unlink(missing_ok=True)
    env = dict(env, DSUNIT_EVENTS=str(events), DSUNIT_DONE=str(done), PYTHONPATH=str(PLUGIN_DIR))
    # The harness's own hang timeout ends the whole session: leave hangs to the two limits above.
    env["DS_UNITTEST_TIMEOUT"] = str(limit_s + 2 * grace_s)
    while True:
        done.write_text("".join(f"{t}\n" for t in progress.outcomes))
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                pytest_command(python, group, limit_s, exclude),
                cwd=tests,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own session: a kill takes the pool workers and builds with it
            )
            killed = False
            while proc.poll() is None:
                offset = _read_new(events, offset, progress)
                if progress.running and time.time() - progress.started_at > limit_s + grace_s:
                    _kill_session(proc)
                    killed = True
                    break
                time.sleep(poll_s)
            offset = _read_new(events, offset, progress)
        if killed:
            ended = progress.end_running("timeout", f"no result after {limit_s + grace_s}s: killed from outside")
            for lock in extensions_dir.glob("*/lock") if extensions_dir is not None else ():
                logger.warning("%s: removing the build lock %s the killed test left", group, lock)
                lock.unlink(missing_ok=True)
        else:
            # Reap what the session left behind (pool workers of a test the harness abandoned).
            _kill_session(proc)
            reason = progress.interrupted or f"the pytest process exited with {proc.returncode} during the test"
            ended = progress.end_running("crashed", reason)
        if ended is None:
            return progress.outcomes
        if ended in ended_before:
            logger.warning("%s: %s ran again after its process was ended; stopping this group", group, ended)
            return progress.outcomes
        ended_before.add(ended)
        logger.warning("%s: %s %s; restarting on the tests not run yet", group, ended, progress.outcomes[ended])
        progress.interrupted = ""
