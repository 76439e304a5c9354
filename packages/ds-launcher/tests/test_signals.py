"""Supervision with real processes: signals to the launcher reach every rank, a failing rank ends the job,
and no process of the job (ranks, their detached children) is left behind, checked by pid."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

HANG = Path(__file__).with_name("hang_job.py")


def _gone(launcher, pids: list[int], within_s: float = 5.0) -> list[int]:
    """The pids still alive after `within_s` (the launcher reaps before exiting; allow for the kernel)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        left = [pid for pid in pids if launcher.alive(pid)]
        if not left:
            return []
        time.sleep(0.05)
    return [pid for pid in pids if launcher.alive(pid)]


def _job_pids(ready: dict) -> list[int]:
    return [r["pid"] for r in ready.values()] + [r["child_pid"] for r in ready.values() if r["child_pid"]]


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_is_forwarded_to_every_rank(launcher, tmp_path: Path, sig: signal.Signals, code: int) -> None:
    signals = tmp_path / "signals"
    signals.mkdir()
    proc = launcher.start("--num_gpus", "2", str(HANG), "--spawn_child", "--signal_dir", str(signals))
    ready = launcher.wait_for_reports(proc, "ready", 2, timeout=30)
    os.kill(proc.pid, sig)
    done = launcher.wait(proc, timeout=15)
    assert done.returncode == code, done.stderr
    assert sorted(p.name for p in signals.iterdir()) == [f"0.{sig.name}", f"1.{sig.name}"]
    assert f"got {sig.name}: forwarding it to 2 process(es)" in done.stderr
    assert _gone(launcher, _job_pids(ready)) == []


def test_failing_rank_ends_the_job_and_stubborn_ranks_are_killed(launcher) -> None:
    proc = launcher.start(
        "--num_gpus", "3", str(HANG), "--spawn_child", "--exit_rank", "1", "--exit_code", "7", "--ignore_term"
    )
    ready = launcher.wait_for_reports(proc, "ready", 3, timeout=30)
    done = launcher.wait(proc, timeout=30)
    assert done.returncode == 7, done.stderr
    assert "rank 1 (pid" in done.stderr and "exited with code 7; stopping the other 2 process(es)" in done.stderr
    assert "2 process(es) still running 5s after SIGTERM: killing" in done.stderr  # ranks ignoring SIGTERM
    assert done.seconds < 15
    assert _gone(launcher, _job_pids(ready)) == []


def test_killed_launcher_takes_its_ranks_down(launcher) -> None:
    proc = launcher.start("--num_gpus", "2", str(HANG))
    ready = launcher.wait_for_reports(proc, "ready", 2, timeout=30)
    os.kill(proc.pid, signal.SIGKILL)  # no chance to clean up: PR_SET_PDEATHSIG does it
    proc.wait(timeout=10)
    assert _gone(launcher, _job_pids(ready)) == []


def test_per_rank_logs_and_the_failing_ranks_tail(launcher, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    done = launcher.run(
        "--num_gpus",
        "2",
        "--enable_each_rank_log",
        str(logs),
        str(HANG),
        "--exit_rank",
        "0",
        "--exit_code",
        "4",
        timeout=30,
    )
    assert done.returncode == 4
    files = sorted(logs.iterdir(), key=lambda p: p.name[-9:])
    assert [p.name.split("_", 1)[1] for p in files] == ["rank0.log", "rank1.log"]
    assert [launcher.parse_reports(p.read_text())[0]["rank"] for p in files] == [0, 1]
    assert done.reports == []  # worker output went to the logs
    assert f"last lines of {files[0]}:" in done.stderr and '"rank": 0' in done.stderr
