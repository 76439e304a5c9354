"""Accelerate's DeepSpeed plugin in a plain loop runs on ds (through the `deepspeed` distribution).

`Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=<file>))`, 2 gloo ranks under torchrun; the
reference is the same loop on Accelerate's plain DDP (gloo, CPU). fp32 losses agree within 1e-5 at
every step; `save_state` after step 4 and `load_state` of it at the end replay steps 5-8 exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launch_job import launch

pytest.importorskip("accelerate")

JOB = Path(__file__).parent / "accelerate_job.py"
TOL = 1e-5


def _run(tmp: Path, name: str, config: dict | None) -> dict:
    summary, extra = tmp / f"{name}.json", []
    if config is not None:
        cfg = tmp / f"{name}_config.json"
        cfg.write_text(json.dumps(config))
        extra = ["--ds_config", str(cfg)]
    launch(JOB, "--state_dir", str(tmp / f"{name}_state"), "--summary", str(summary), *extra)
    return json.loads(summary.read_text())


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> dict:
    run = _run(tmp_path_factory.mktemp("acc_ddp"), "ddp", None)
    assert run["distributed_type"] == "DistributedType.MULTI_CPU"
    return run


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [2, 3])
def test_plain_loop_matches_ddp_and_state_round_trips(tmp_path: Path, ddp: dict, stage: int) -> None:
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": float("inf"),
        "zero_optimization": {"stage": stage},
    }
    run = _run(tmp_path, f"zero{stage}", config)
    assert run["distributed_type"] == "DistributedType.DEEPSPEED"
    assert len(run["losses"]) == len(ddp["losses"]) == 8
    for got, want in zip(run["losses"], ddp["losses"], strict=True):
        assert abs(got - want) <= TOL, (run["losses"], ddp["losses"])
    assert run["checksum"] == pytest.approx(ddp["checksum"], rel=1e-6)
    # load_state put the step-4 weights, optimizer and scheduler back: steps 5-8 replay bit for bit.
    assert run["checksum_at_load"] == pytest.approx(ddp["checksum_at_load"], rel=1e-6)
    assert run["losses_after_load"] == run["losses"][4:]
    assert run["checksum_after_load"] == run["checksum"]
    assert (tmp_path / f"zero{stage}_state" / "pytorch_model").is_dir()
