"""A rank of a real training job raises at step 3: the job ends non-zero within 10 s, the traceback is
visible, and no process of the job remains (ranks and a detached grandchild, checked by pid)."""

from __future__ import annotations

import time

import pytest


@pytest.mark.timeout(120)
def test_rank_raising_at_step_3_ends_the_job(launcher) -> None:
    proc = launcher.start(
        "--num_gpus", "2", str(launcher.job), "--steps", "200", "--fail_rank", "1", "--fail_step", "3", "--spawn_child"
    )
    done = launcher.wait(proc, timeout=100)
    ended = time.time()
    ready = done.by_event("ready")
    (failing,) = done.by_event("failing").values()
    assert done.returncode == 1, done.stderr
    assert ended - failing["t"] < 10
    assert "Traceback (most recent call last)" in done.stderr
    assert "RuntimeError: injected failure on rank 1 at step 3" in done.stderr
    assert "exited with code 1; stopping the other" in done.stderr
    assert done.by_event("done") == {}
    pids = [r["pid"] for r in ready.values()] + [r["child_pid"] for r in ready.values()]
    assert len(pids) == 4
    deadline = time.monotonic() + 5
    while any(launcher.alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in pids if launcher.alive(p)] == []
