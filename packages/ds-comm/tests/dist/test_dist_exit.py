"""At normal exit ds_comm destroys the process groups (gloo could otherwise abort a finished run with SIGABRT).

Each test starts two real processes that end on their own, as a `deepspeed`-launched script does; the
harness in ds_comm.testing destroys its groups itself, so it cannot show this.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ds_comm.testing import free_port

JOB = Path(__file__).with_name("exit_job.py")


def _launch(*args: str) -> list[subprocess.Popen[str]]:
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "OMP_NUM_THREADS": "1",
    }
    return [
        subprocess.Popen(
            [sys.executable, str(JOB), *args],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]


def _finish(procs: list[subprocess.Popen[str]], timeout: float = 60) -> list[tuple[int, str, str]]:
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        results.append((p.returncode, out, err))
    return results


@pytest.mark.timeout(120)
def test_groups_are_destroyed_at_normal_exit() -> None:
    for rc, out, err in _finish(_launch("normal")):
        assert rc == 0, err
        assert "after ds_comm's exit hook: initialized=False" in out, out + err


@pytest.mark.timeout(120)
def test_uncaught_exception_exits_with_status_1_after_the_teardown() -> None:
    for rc, out, err in _finish(_launch("raise")):
        assert rc == 1, err  # Python's status for an uncaught exception, not gloo's SIGABRT (134)
        assert "the script failed here" in err
        assert "after ds_comm's exit hook: initialized=False" in out, out + err


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("ending", "message"),
    [
        ("stray", "a collective is still in flight"),
        ("stray-nothread", "in _destroy_at_exit"),
        ("stray-raise", "the script raised (its traceback is above); destroying"),
    ],
)
def test_teardown_stuck_on_a_stray_collective_gives_up_with_a_message(ending: str, message: str) -> None:
    start = time.monotonic()
    procs = _launch(ending, "2", "30")
    rc0, out0, err0 = _finish(procs[:1])[0]
    elapsed = time.monotonic() - start
    procs[1].kill()
    procs[1].communicate()
    assert rc0 == 1, out0 + err0
    assert "rank 0 done" in out0
    assert message in err0, err0
    assert elapsed < 25, f"rank 0 took {elapsed:.1f} s to exit; the watchdog allows 2 s"
