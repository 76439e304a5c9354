"""`engine.tput_timer`: DeepSpeed's throughput accounting (warm-up steps, accumulation windows, averages).

The timer is driven with a scripted clock (every read advances it by a known amount), so every
duration, rate and average has an exact expected value; then an engine is trained with gradient
accumulation and its timer's counters are checked against the steps taken.
"""

from __future__ import annotations

import itertools
import math

import pytest
from ds_engine_testkit import base_config, batches, loss_fn, make_engine, tiny_net

from ds_engine._report import timers as _timers
from ds_engine._report.timers import ThroughputTimer


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Each clock read returns the next value of 10, 10.5, 11.5, 13, ... (steps of 0.5, 1, 1.5, ...)."""
    reads: list[float] = []
    gaps = itertools.count(1)
    now = [10.0]

    def fake() -> float:
        value = now[0]
        now[0] += 0.5 * next(gaps)
        reads.append(value)
        return value

    monkeypatch.setattr(_timers.time, "time", fake)
    return reads


def test_warm_up_steps_are_not_timed_and_windows_add_up(clock: list[float]) -> None:
    timer = ThroughputTimer(None, batch_size=12, start_step=2)
    timer.stop()  # not started: nothing happens
    assert not timer.initialized and timer.micro_step_count == 0
    # 2 optimizer steps of 2 micro steps each: counted, not timed
    for micro in range(4):
        timer.start()
        timer.stop(global_step=micro % 2 == 1)
    assert (timer.micro_step_count, timer.global_step_count) == (4, 2)
    assert timer.start_time == 0 and timer.total_elapsed_time == 0 and clock == []
    assert timer.avg_samples_per_sec() == -math.inf
    # step 3: two timed micro steps; the clock reads 10, 10.5 | 11.5, 13
    timer.start()
    timer.stop()
    assert timer.step_elapsed_time == 0.5
    timer.start()
    timer.stop(global_step=True)
    assert timer.step_elapsed_time == 0  # reset at the boundary
    assert timer.total_elapsed_time == 2.0
    assert timer.last_samples_per_sec == 12 / 2.0
    # step 4: reads 15, 17.5 -> 2.5 s
    timer.start()
    timer.stop(global_step=True)
    assert timer.last_samples_per_sec == 12 / 2.5
    assert timer.avg_samples_per_sec() == pytest.approx(2 * 12 / 4.5)
    assert clock == [10.0, 10.5, 11.5, 13.0, 15.0, 17.5]


def test_a_disabled_timer_counts_nothing(clock: list[float]) -> None:
    timer = ThroughputTimer(None, batch_size=4, enabled=False)
    for _ in range(5):
        timer.start()
        timer.stop(global_step=True)
    assert (timer.initialized, timer.micro_step_count, timer.global_step_count) == (False, 0, 0)
    assert clock == []


def test_the_engine_starts_it_at_forward_and_stops_it_at_step() -> None:
    engine = make_engine(tiny_net(0), base_config(gradient_accumulation_steps=3))
    timer = engine.tput_timer
    assert timer.batch_size == 4 * 3 and timer.start_step == 2 and not timer.initialized
    for x, y in batches(12, 4):
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    assert (timer.micro_step_count, timer.global_step_count) == (12, 4)
    assert not timer.started and timer.total_elapsed_time > 0
    assert timer.avg_samples_per_sec() > 0


def test_timers_throughput_enabled_false_leaves_it_idle() -> None:
    engine = make_engine(tiny_net(0), base_config(timers={"throughput": {"enabled": False}}))
    for x, y in batches(3, 4):
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    assert engine.tput_timer.global_step_count == 0 and not engine.tput_timer.initialized
