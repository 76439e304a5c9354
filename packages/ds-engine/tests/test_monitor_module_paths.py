"""`deepspeed.monitor.*`: DeepSpeed's monitor classes, built from config sections, writing through ds's backends."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from ds_engine import DeepSpeedConfig
from ds_engine._report.monitors import tensorboard_available
from ds_engine.monitor.comet import CometMonitor
from ds_engine.monitor.config import DeepSpeedMonitorConfig, get_monitor_config
from ds_engine.monitor.csv_monitor import csvMonitor
from ds_engine.monitor.monitor import MonitorMaster
from ds_engine.monitor.tensorboard import TensorBoardMonitor
from ds_engine.monitor.wandb import WandbMonitor


def test_sections_read_from_a_config() -> None:
    config = DeepSpeedConfig(
        {
            "train_batch_size": 2,
            "tensorboard": {"enabled": False, "output_path": "out/", "job_name": "tb"},
            "wandb": {"group": "g", "team": "t", "project": "p"},
        }
    )
    monitor_config = config.monitor_config
    assert isinstance(monitor_config, DeepSpeedMonitorConfig) and not monitor_config.enabled
    tb = TensorBoardMonitor(monitor_config.tensorboard)
    assert (tb.enabled, tb.output_path, tb.job_name, tb.summary_writer) == (False, "out/", "tb", None)
    wb = WandbMonitor(monitor_config.wandb)
    assert (wb.enabled, wb.group, wb.team, wb.project) == (False, "g", "t", "p")
    defaults = DeepSpeedMonitorConfig()
    csv_default = csvMonitor(defaults.csv_monitor)
    assert (csv_default.enabled, csv_default.job_name) == (False, "DeepSpeedJobName")
    comet = CometMonitor(defaults.comet)
    assert (comet.enabled, comet.samples_log_interval, comet.experiment) == (False, 100, None)
    tb.write_events([("x", 1.0, 1)])  # disabled: nothing happens, nothing raises


def test_get_monitor_config_validates_the_sections() -> None:
    assert get_monitor_config({"csv_monitor": {"enabled": True}}).enabled
    with pytest.raises(ValueError, match="csv_monitor.enabledd"):
        get_monitor_config({"csv_monitor": {"enabledd": True}})


def test_master_writes_csv_rows(tmp_path: Path) -> None:
    monitor_config = get_monitor_config(
        {"csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "j"}}
    )
    master = MonitorMaster(monitor_config)
    assert master.enabled and master.csv_monitor is not None and master.tb_monitor is None
    master.write_events([("Train/loss", 0.5, 4), ("Train/loss", 0.25, 8)])
    master.close()
    files = list((tmp_path / "j").iterdir())
    assert len(files) == 1
    with files[0].open() as handle:
        rows = list(csv.reader(handle))
    assert rows[-2:] == [["4", "0.5"], ["8", "0.25"]]


@pytest.mark.skipif(not tensorboard_available(), reason="needs the tensorboard package")
def test_tensorboard_writer_on_rank_zero(tmp_path: Path) -> None:
    section = get_monitor_config({"tensorboard": {"enabled": True, "output_path": str(tmp_path), "job_name": "tb"}})
    tb = TensorBoardMonitor(section.tensorboard)
    assert tb.summary_writer is not None
    tb.write_events([("a", 1.0, 1)])
    tb.flush()
    assert any((tmp_path / "tb").iterdir())
