"""ds's consolidation of a DeepSpeed 0.19.8 checkpoint equals its own `zero_to_fp32.py` and `zero_to_torch.py`.

The checkpoint (`z3_tied_frozen_fp32`: ZeRO-3 on 2 ranks, a frozen layer, tied weights, a one-element
parameter, sizes the world size does not divide, two param groups) and what DeepSpeed's two scripts
made of it (`zero_to_fp32.bin`, `zero_to_torch_bf16.bin`) are test data from
`deepspeed_fixtures/make_fixtures.py`; DeepSpeed is not needed here. Every ds path must give the same
names, dtypes and values, bit for bit, with tied names sharing one tensor:

* the torch-only `zero_to_fp32.py` and `zero_to_torch.py` ds copies into save directories, run there
  with no ds package (nor deepspeed) importable;
* `python -m ds_engine.utils.zero_to_fp32` and `python -m ds_engine.utils.zero_to_torch` (ds-zero's);
* `get_fp32_state_dict_from_zero_checkpoint`.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

FIXTURES = Path(__file__).resolve().parent / "deepspeed_fixtures"
DATA = FIXTURES / "data"
sys.path.insert(0, str(FIXTURES))
import make_fixtures  # noqa: E402

CASES = [c for c in make_fixtures.CONSOLIDATED_CASES if (DATA / c / "zero_to_fp32.bin").is_file()]
_NO_DS = (
    "import runpy, sys\n"
    "for name in ('ds_comm', 'ds_ops', 'ds_zero', 'ds_engine', 'ds_pipe', 'deepspeed'):\n"
    "    sys.modules[name] = None  # importing any of them now fails\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def _run(cmd: list[str], cwd: Path | None = None) -> None:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert got[name].shape == want[name].shape and torch.equal(got[name], want[name]), name
    # a tied pair is one tensor in both
    ties = {(a, b) for a in want for b in want if a < b and want[a].data_ptr() == want[b].data_ptr()}
    assert ties, "the fixture has tied weights"
    for a, b in ties:
        assert got[a].data_ptr() == got[b].data_ptr(), (a, b)


def _save_dir(case: str, tmp_path: Path) -> Path:
    """A copy of the case's save directory with ds's two scripts in it (as ds's engine puts them there)."""
    from ds_zero import copy_recovery_scripts

    dst = tmp_path / "ckpt"
    shutil.copytree(DATA / case / "ckpt", dst)
    copy_recovery_scripts(dst)
    return dst


def _deepspeeds(case: str, stored: str) -> dict:
    return torch.load(DATA / case / stored, weights_only=True)


@pytest.mark.parametrize("case", CASES)
def test_copied_scripts_equal_deepspeeds_with_torch_only(case, tmp_path):
    save_dir = _save_dir(case, tmp_path)
    _run([sys.executable, "-c", _NO_DS, "zero_to_fp32.py", ".", str(tmp_path / "fp32")], cwd=save_dir)
    _assert_same(torch.load(tmp_path / "fp32" / "pytorch_model.bin"), _deepspeeds(case, "zero_to_fp32.bin"))
    cmd = [sys.executable, "-c", _NO_DS, "zero_to_torch.py", ".", str(tmp_path / "bf16"), "--dtype", "bf16"]
    _run(cmd, cwd=save_dir)
    _assert_same(torch.load(tmp_path / "bf16" / "pytorch_model.bin"), _deepspeeds(case, "zero_to_torch_bf16.bin"))


@pytest.mark.parametrize("case", CASES)
def test_ds_modules_equal_deepspeeds(case, tmp_path):
    from ds_zero import get_fp32_state_dict_from_zero_checkpoint

    save_dir = _save_dir(case, tmp_path)
    want = _deepspeeds(case, "zero_to_fp32.bin")
    _assert_same(get_fp32_state_dict_from_zero_checkpoint(save_dir), want)
    _run([sys.executable, "-m", "ds_engine.utils.zero_to_fp32", "-q", str(save_dir), str(tmp_path / "fp32")])
    _assert_same(torch.load(tmp_path / "fp32" / "pytorch_model.bin"), want)
    cmd = [sys.executable, "-m", "ds_engine.utils.zero_to_torch", "-q", str(save_dir), str(tmp_path / "bf16")]
    _run([*cmd, "--dtype", "bfloat16"])
    _assert_same(torch.load(tmp_path / "bf16" / "pytorch_model.bin"), _deepspeeds(case, "zero_to_torch_bf16.bin"))


def test_the_fixture_holds_what_it_is_for():
    """A frozen layer (its stage-3 placeholders and per-rank fragments), a tied alias, uneven sizes."""
    import ds_comm

    assert CASES == ["z3_tied_frozen_fp32"]
    tag = DATA / CASES[0] / "ckpt" / "global_step3"
    ranks = [ds_comm.load_checkpoint_file(tag / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt") for r in (0, 1)]
    assert ranks[0]["shared_params"] == {"mid_tied.weight": "mid.weight"} and ranks[1]["shared_params"] == {}
    assert list(ranks[0]["frozen_param_shapes"]) == ["frozen.weight", "frozen.bias"]
    assert all(ranks[0]["module"][n].numel() == 0 for n in ("frozen.weight", "mid_tied.weight", "scale"))
    assert [len(g) for g in ranks[0]["param_shapes"]] == [3, 5]  # two param groups
