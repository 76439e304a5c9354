"""Lightning Fabric loops: ds-zero alone (`ds_zero.ZeroOptimizer` directly), and Fabric's DeepSpeed strategy.

No engine and no `deepspeed` distribution: Fabric launches, starts the process group and shards the
data; ds-zero partitions the optimizer state (stage 1) and the gradients (stage 2). The reference is
Fabric's own DDP on the same loop: fp32 losses within 1e-5 at every step. The job records that neither
ds_engine nor deepspeed was imported (this venv has them installed; the ds-zero package session
proves the install side: ds-zero with only ds-comm and ds-ops). Fabric's DeepSpeedStrategy at stage 2
and 3 (through the `deepspeed` distribution) matches too, and `fabric.save`/`fabric.load` round-trips.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launch_job import launch

pytest.importorskip("lightning")

JOB = Path(__file__).parent / "fabric_zero_job.py"
TOL = 1e-5


def _run(tmp: Path, stage: int) -> dict:
    summary = tmp / f"zero{stage}.json"
    launch(JOB, "--zero", str(stage), "--summary", str(summary))
    return json.loads(summary.read_text())


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _run(tmp_path_factory.mktemp("fabric_ddp"), 0)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [1, 2])
def test_fabric_loop_with_ds_zero_matches_fabric_ddp(tmp_path: Path, ddp: dict, stage: int) -> None:
    run = _run(tmp_path, stage)
    assert run["imported"] == ["ds_zero"] and ddp["imported"] == []
    assert len(run["losses"]) == len(ddp["losses"]) == 8
    for got, want in zip(run["losses"], ddp["losses"], strict=True):
        assert abs(got - want) <= TOL, (run["losses"], ddp["losses"])
    assert run["checksum"] == pytest.approx(ddp["checksum"], rel=1e-6)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [2, 3])
def test_fabric_deepspeed_strategy_matches_ddp_and_save_load_round_trips(tmp_path: Path, ddp: dict, stage: int) -> None:
    summary = tmp_path / "fabric_ds.json"
    launch(JOB, "--deepspeed", str(stage), "--ckpt", str(tmp_path / "ckpt"), "--summary", str(summary))
    run = json.loads(summary.read_text())
    assert run["partitioned"] is (stage == 3)
    for got, want in zip(run["losses"], ddp["losses"], strict=True):
        assert abs(got - want) <= TOL, (run["losses"], ddp["losses"])
    assert run["checksum"] == pytest.approx(ddp["checksum"], rel=1e-6)
    # fabric.load found the engine and its optimizer (DeepSpeedOptimizer) in the state: exact replay
    assert run["step_loaded"] == 4
    assert run["losses_after_load"] == run["losses"][4:] and run["checksum_after_load"] == run["checksum"]
