"""ds-zero alone inside a framework: a Lightning Fabric loop sharding with `ds_zero.ZeroOptimizer` directly.

No engine and no `deepspeed` distribution: Fabric launches, starts the process group and shards the
data; ds-zero partitions the optimizer state (stage 1) and the gradients (stage 2). The reference is
Fabric's own DDP on the same loop: fp32 losses within 1e-5 at every step. The job records that neither
ds_engine nor deepspeed was imported (this venv has them installed; the ds-zero package session
proves the install side: ds-zero with only ds-comm and ds-ops).
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


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 2])
def test_fabric_loop_with_ds_zero_matches_fabric_ddp(tmp_path: Path, ddp: dict, stage: int) -> None:
    run = _run(tmp_path, stage)
    assert run["imported"] == ["ds_zero"] and ddp["imported"] == []
    assert len(run["losses"]) == len(ddp["losses"]) == 8
    for got, want in zip(run["losses"], ddp["losses"], strict=True):
        assert abs(got - want) <= TOL, (run["losses"], ddp["losses"])
    assert run["checksum"] == pytest.approx(ddp["checksum"], rel=1e-6)
