"""Lightning's DeepSpeed strategies (`"deepspeed_stage_2"`, `"deepspeed_stage_3"`) fit on ds.

2 ranks under torchrun, a LightningModule with torch AdamW and gradient clipping; the reference is the
same fit with `strategy="ddp"` on the CPU. fp32 losses agree within 1e-5 at every step, and so do the
runs resumed from the step-4 checkpoint (Lightning's DeepSpeed checkpoint is a directory holding
DeepSpeed's layout). See lightning_job.py for the one CUDA-only check lifted on this CPU host.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launch_job import launch

pytest.importorskip("lightning")

JOB = Path(__file__).parent / "lightning_job.py"
TOL = 1e-5


def _fit(tmp: Path, strategy: str, name: str, resume: Path | None = None) -> dict:
    summary = tmp / f"{name}.json"
    launch(
        JOB,
        "--strategy",
        strategy,
        "--ckpt_dir",
        str(tmp / f"{name}_ckpt"),
        "--summary",
        str(summary),
        *(["--resume", str(resume)] if resume else []),
    )
    return {rank: json.loads(Path(f"{summary}.{rank}").read_text()) for rank in (0, 1)}


def _close(a: dict, b: dict) -> None:
    for rank in (0, 1):
        assert a[rank]["losses"].keys() == b[rank]["losses"].keys()
        for step, loss in b[rank]["losses"].items():
            assert abs(a[rank]["losses"][step] - loss) <= TOL, (rank, step, a[rank]["losses"], b[rank]["losses"])
        assert a[rank]["checksum"] == pytest.approx(b[rank]["checksum"], rel=1e-6)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    tmp = tmp_path_factory.mktemp("pl_ddp")
    fit = _fit(tmp, "ddp", "ddp")
    return fit, _fit(tmp, "ddp", "ddp_resumed", resume=tmp / "ddp_ckpt" / "step=4.ckpt")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["deepspeed_stage_2", "deepspeed_stage_3"])
def test_fit_and_resume_match_ddp(tmp_path: Path, ddp: tuple[dict, dict], strategy: str) -> None:
    ref_fit, ref_resumed = ddp
    fit = _fit(tmp_path, strategy, "fit")
    assert fit[0]["engine"] == "DeepSpeedEngine" and fit[0]["global_step"] == 8
    assert list(fit[0]["losses"]) == [str(i) for i in range(1, 9)]
    _close(fit, ref_fit)
    ckpt = tmp_path / "fit_ckpt" / "step=4.ckpt"
    assert (ckpt / "latest").is_file() and (ckpt / "checkpoint").is_dir()  # DeepSpeed's checkpoint layout

    resumed = _fit(tmp_path, strategy, "resumed", resume=ckpt)
    assert resumed[0]["global_step"] == 8
    _close(resumed, ref_resumed)
    # The first step after the restore is the same update the uninterrupted run made.
    assert resumed[0]["losses"]["5"] == fit[0]["losses"]["5"]
