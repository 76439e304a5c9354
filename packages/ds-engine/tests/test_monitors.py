"""Progress lines, wall-clock timers, and the CSV monitor's events (loss, lr, loss scale, samples/sec)."""

from __future__ import annotations

import csv
import logging
from pathlib import Path

import pytest
from ds_engine_testkit import base_config, batches, loss_fn, make_engine, tiny_net

from ds_engine._report.monitors import TensorBoardMonitor, tensorboard_available


def _rows(path: Path) -> list[list[str]]:
    with path.open() as handle:
        return list(csv.reader(handle))


def test_csv_events_progress_line_and_timers(tmp_path: Path, caplog) -> None:
    engine = make_engine(
        tiny_net(0),
        base_config(
            steps_per_print=2,
            wall_clock_breakdown=True,
            gradient_accumulation_steps=2,
            csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "job"},
        ),
    )
    losses = []
    with caplog.at_level(logging.INFO, logger="ds_engine"):
        for i, (x, y) in enumerate(batches(8, 4)):
            loss = loss_fn(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if i == 5:
                timers = engine.get_wall_clock_timers()
                assert {"forward", "backward", "backward_inner", "step"} <= set(timers)
                assert all(ms >= 0 for ms in timers.values())
    job = tmp_path / "job"
    loss_rows = _rows(job / "Train_Samples_train_loss.csv")
    assert loss_rows[0] == ["step", "train_loss"]
    assert [int(r[0]) for r in loss_rows[1:]] == [8, 16, 24, 32]  # keyed by global_samples
    expected = [(losses[2 * i] + losses[2 * i + 1]) / 2 for i in range(4)]  # mean over the accumulation window
    assert [float(r[1]) for r in loss_rows[1:]] == pytest.approx(expected, rel=1e-6)
    assert [float(r[1]) for r in _rows(job / "Train_Samples_lr.csv")[1:]] == [0.01] * 4
    assert [float(r[1]) for r in _rows(job / "Train_Samples_loss_scale.csv")[1:]] == [1.0] * 4
    # the first 2 optimizer steps are warm-up, left out of the throughput (DeepSpeed's start_step)
    assert [int(r[0]) for r in _rows(job / "Train_Samples_samples_per_sec.csv")[1:]] == [24, 32]
    assert len(_rows(job / "Train_Samples_elapsed_time_ms_forward.csv")) == 1 + 2  # at each progress line
    lines = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("[Rank 0] step=2, skipped=0, lr=[0.01], loss_scale=1, samples/sec=") for m in lines)
    assert any("time (ms) | forward:" in m and "| step:" in m for m in lines)
    assert sum("step=" in m for m in lines) == 2


def test_no_monitor_and_no_progress_by_default(caplog) -> None:
    engine = make_engine(tiny_net(0), base_config())
    assert engine.monitor is None and engine.get_wall_clock_timers() == {}
    with caplog.at_level(logging.INFO, logger="ds_engine"):
        for x, y in batches(3, 4):
            engine.backward(loss_fn(engine(x), y))
            engine.step()
    assert not [r for r in caplog.records if "step=" in r.getMessage()]


def test_tensorboard_monitor_writes_or_explains(tmp_path: Path) -> None:
    if not tensorboard_available():
        with pytest.raises(ImportError, match="pip install tensorboard"):
            TensorBoardMonitor(str(tmp_path), "job")
        return
    engine = make_engine(
        tiny_net(0), base_config(tensorboard={"enabled": True, "output_path": str(tmp_path), "job_name": "tb"})
    )
    for x, y in batches(2, 4):
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    engine.destroy()
    assert any((tmp_path / "tb").iterdir())
