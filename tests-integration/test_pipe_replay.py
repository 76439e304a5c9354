"""`benchmarks/_pipe_replay.replay`: a traced pipeline batch replayed with free communication.

The traces are built from ds_pipe's own `TrainSchedule` streams (the instruction order the executor runs),
so the replay is checked on the real schedule: equal stage times give the 1F1B theory exactly, and a slow
micro-batch delays every stage that waits for it, which sequential execution would not.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))

from _pipe_replay import mean_stage_seconds, replay  # noqa: E402 - benchmarks/ is a script folder

from ds_pipe import schedule  # noqa: E402

SENDS = (schedule.SendActivation, schedule.SendGrad)


def _traces(m: int, p: int, forward: float, backward: float, slow: dict[tuple[int, int], float] | None = None):
    """Each stage's stream as the executor runs it (a step's sends first), with made-up durations;
    `slow[(stage, k)]` adds seconds to that stage's k-th forward."""
    traces = []
    for stage in range(p):
        trace, forwards = [], 0
        for step in schedule.TrainSchedule(m, p, stage):
            for c in [c for c in step if isinstance(c, SENDS)] + [c for c in step if not isinstance(c, SENDS)]:
                seconds = 0.5 if isinstance(c, (*SENDS, schedule.RecvActivation, schedule.RecvGrad)) else 0.0
                if isinstance(c, schedule.ForwardPass):
                    seconds = forward + (slow or {}).get((stage, forwards), 0.0)
                    forwards += 1
                elif isinstance(c, schedule.BackwardPass):
                    seconds = backward
                trace.append((c.name, seconds))
        traces.append(trace)
    return traces


@pytest.mark.parametrize(("m", "p"), [(1, 1), (4, 2), (16, 4), (3, 4)])
def test_equal_stage_times_replay_to_the_theory(m: int, p: int) -> None:
    traces = _traces(m, p, forward=1.0, backward=2.0)
    assert replay(traces) == pytest.approx((m + p - 1) * 3.0)  # the sends' and receives' 0.5 s are not counted
    assert mean_stage_seconds(traces) == pytest.approx(3.0)


def test_a_slow_micro_batch_costs_the_pipeline_more_than_its_mean() -> None:
    even = replay(_traces(8, 4, 1.0, 2.0))
    slow = replay(_traces(8, 4, 1.0, 2.0, slow={(1, 3): 0.8, (2, 5): 0.8}))
    # 1.6 s of extra work spread over 4 stages is 0.4 s of mean stage time, but each delay sits on the path
    assert slow - even > 0.8
    assert slow - even <= 1.6 + 1e-9


def test_streams_that_do_not_pair_are_an_error() -> None:
    traces = _traces(4, 2, 1.0, 2.0)
    traces[1] = [t for t in traces[1] if t[0] != "SendGrad"]  # stage 0 would wait forever for its gradients
    with pytest.raises(RuntimeError, match="do not pair up"):
        replay(traces)
