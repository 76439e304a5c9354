"""DeepSpeed's own `zero_to_fp32.py` and `zero_to_torch.py` on ds's saves (real DeepSpeed 0.19.8; skipped elsewhere).

`DS_REFERENCE_PYTHON` names the python of a venv with the pinned DeepSpeed. ds trains `TiedFrozenNet`
(a frozen layer, tied weights, a one-element parameter, two param groups; `deepspeed_fixtures/border_job.py`)
on 2 ranks at ZeRO 1, 2 and 3 and saves in both layouts, ds's and DeepSpeed's; then DeepSpeed's scripts,
taken from that venv and run as a user runs them, consolidate the save. Their output must equal the
model's weights bit for bit (fp32 training): every parameter, tied names included, and the buffer. At
ZeRO 1 DeepSpeed records no frozen parameters (its `frozen_param_*` are None there, in its own saves
too), so its script leaves them out; that is all it may leave out.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ds_comm.testing import run_ranks

FIXTURES = Path(__file__).resolve().parent / "deepspeed_fixtures"
sys.path.insert(0, str(FIXTURES))
import border_job  # noqa: E402

REFERENCE = os.environ.get("DS_REFERENCE_PYTHON")
pytestmark = pytest.mark.skipif(not REFERENCE, reason="DS_REFERENCE_PYTHON (a venv with deepspeed==0.19.8) not set")
CASE = "z3_tied_frozen_fp32"
FROZEN = ("frozen.weight", "frozen.bias")


def _train_and_save(rank: int, world: int, stage: int, layout: str, save_dir: str) -> dict[str, torch.Tensor]:
    import ds_engine
    import ds_zero

    engine = border_job.build(ds_engine, CASE, world, stage=stage, layout=layout)
    border_job.train(engine, 0, border_job.STEPS_BEFORE, rank, world, torch.float32)
    engine.save_checkpoint(save_dir)
    if stage == 3:
        return ds_zero.consolidated_16bit_state_dict(engine.module, rank0_only=False)
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def _deepspeed_scripts(tmp_path: Path) -> Path:
    """DeepSpeed's two scripts, copied out of the reference venv (run from their own folder, as in a save)."""
    where = subprocess.run(
        [REFERENCE, "-c", "import deepspeed.utils.zero_to_fp32 as m; print(m.__file__)"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": ""},
    ).stdout.strip()
    scripts = tmp_path / "deepspeed_scripts"
    scripts.mkdir()
    for name in ("zero_to_fp32.py", "zero_to_torch.py"):
        shutil.copy(Path(where).with_name(name), scripts / name)
    return scripts


def _run(script: Path, save_dir: Path, out: Path, *args: str) -> dict[str, torch.Tensor]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [REFERENCE, str(script), str(save_dir), str(out), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "DS_ACCELERATOR": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out / "pytorch_model.bin", weights_only=True)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", ["ds", "deepspeed"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeeds_scripts_rebuild_the_weights_of_a_ds_save(stage, layout, tmp_path):
    save_dir = tmp_path / "ckpt"
    want = run_ranks(2, _train_and_save, stage, layout, str(save_dir), timeout_s=400)[0]
    scripts = _deepspeed_scripts(tmp_path)
    got = _run(scripts / "zero_to_fp32.py", save_dir, tmp_path / "fp32")
    expected = {k: v for k, v in want.items() if not (stage == 1 and k in FROZEN)}
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], value), name
    assert got["mid_tied.weight"].data_ptr() == got["mid.weight"].data_ptr()  # tied, as DeepSpeed rebuilds them
    bf16 = _run(scripts / "zero_to_torch.py", save_dir, tmp_path / "bf16", "--dtype", "bf16")
    assert sorted(bf16) == sorted(expected)
    for name, value in expected.items():
        assert torch.equal(bf16[name], value.to(torch.bfloat16)), name
