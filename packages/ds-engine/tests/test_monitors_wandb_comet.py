"""wandb and Comet monitors: DeepSpeed's event names reach the run, read back from their offline files.

With the package installed (nox pins it for ds-engine's session) the real client runs in its offline
mode and the test reads what it wrote; without it, the engine must refuse the config naming the
package to install.
"""

from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest
from ds_engine_testkit import base_config, batches, loss_fn, make_engine, tiny_net

from ds_engine._report.monitors import comet_available, wandb_available
from ds_engine._report.monitors._comet import _LogThrottle

_NAMES = {"Train/Samples/train_loss", "Train/Samples/lr", "Train/Samples/loss_scale"}


def _train(config: dict[str, Any], steps: int = 4) -> list[float]:
    engine = make_engine(tiny_net(0), config)
    losses = []
    for x, y in batches(steps, 4):
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.destroy()
    return losses


def _wandb_records(path: Path) -> list[bytes]:
    """Protobuf payloads of a `.wandb` file: a 7-byte header, then LevelDB-log records in 32 KiB blocks."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a wandb transaction log"
    out: list[bytes] = []
    pending = b""
    pos = 7
    block = 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the rest of a block too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            break
        payload = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        pending += payload
        if kind in (1, 4):  # FULL or LAST completes a record
            out.append(pending)
            pending = b""
    return out


def _wandb_history(run_file: Path) -> dict[str, list[tuple[int, float]]]:
    from wandb.proto import wandb_internal_pb2 as pb

    series: dict[str, list[tuple[int, float]]] = {}
    for payload in _wandb_records(run_file):
        record = pb.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") != "history":
            continue
        row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        for name, value in row.items():
            if name.startswith("Train/"):
                series.setdefault(name, []).append((int(row["_step"]), float(value)))
    return series


def test_wandb_offline_run_gets_deepspeed_events(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = base_config(wandb={"enabled": True, "project": "ds-test", "group": "g1"})
    if not wandb_available():
        with pytest.raises(ImportError, match="pip install wandb"):
            make_engine(tiny_net(0), config)
        return
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    losses = _train(config)  # engine.destroy() finishes the run
    import wandb

    wandb.teardown()  # the run file is written by wandb's service process: wait for it to flush and exit
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    history = _wandb_history(run_file)
    assert _NAMES <= set(history)
    assert [s for s, _ in history["Train/Samples/train_loss"]] == [4, 8, 12, 16]  # step = global samples
    assert [v for _, v in history["Train/Samples/train_loss"]] == pytest.approx(losses, rel=1e-6)
    assert [v for _, v in history["Train/Samples/lr"]] == pytest.approx([0.01] * 4)
    assert [v for _, v in history["Train/Samples/loss_scale"]] == [1.0] * 4


def _comet_metrics(archive: Path) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    with zipfile.ZipFile(archive) as zf:
        lines = zf.read("messages.json").decode().splitlines()
    for line in lines:
        message = json.loads(line)
        if message.get("type") != "metric_msg":
            continue
        metric = message["payload"]["metric"]
        if metric["metricName"].startswith("Train/"):
            series.setdefault(metric["metricName"], []).append((metric["step"], float(metric["metricValue"])))
    return series


def test_comet_offline_experiment_gets_events_every_interval(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    section = {"enabled": True, "online": False, "samples_log_interval": 8, "experiment_name": "ds-run"}
    config = base_config(comet=section)
    if not comet_available():
        with pytest.raises(ImportError, match="pip install comet_ml"):
            make_engine(tiny_net(0), config)
        return
    monkeypatch.setenv("COMET_OFFLINE_DIRECTORY", str(tmp_path))
    monkeypatch.setenv("COMET_DISABLE_AUTO_LOGGING", "1")
    losses = _train(config, steps=5)
    (archive,) = tmp_path.glob("*.zip")
    metrics = _comet_metrics(archive)
    assert _NAMES <= set(metrics)
    # samples 4, 8, ..., 20; interval 8: logged at 4, then at 12 (4 + 8), then at 20
    loss = metrics["Train/Samples/train_loss"]
    assert [s for s, _ in loss] == [4, 12, 20]
    assert [v for _, v in loss] == pytest.approx([losses[0], losses[2], losses[4]], rel=1e-6)
    with zipfile.ZipFile(archive) as zf:
        assert json.loads(zf.read("experiment.json")).get("offline_experiment") is not False
        assert "ds-run" in zf.read("messages.json").decode()


def test_comet_throttle_per_name() -> None:
    throttle = _LogThrottle(100)
    assert [throttle.due("a", s) for s in (0, 50, 99, 100, 150, 200)] == [True, False, False, True, False, True]
    assert throttle.due("b", 150)  # each name keeps its own clock


def test_missing_packages_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import ds_engine._report.monitors._comet as comet_mod
    import ds_engine._report.monitors._wandb as wandb_mod

    monkeypatch.setattr(wandb_mod, "wandb_available", lambda: False)
    monkeypatch.setattr(comet_mod, "comet_available", lambda: False)
    with pytest.raises(ImportError, match=r"wandb.enabled is true .*pip install wandb"):
        make_engine(tiny_net(0), base_config(wandb={"enabled": True}))
    with pytest.raises(ImportError, match=r"comet.enabled is true .*pip install comet_ml"):
        make_engine(tiny_net(0), base_config(comet={"enabled": True}))
