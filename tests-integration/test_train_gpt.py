"""Launcher-driven training of the example GPT, checked step by step against a plain-PyTorch reference.

Every test launches `deepspeed --num_gpus N examples/train_gpt.py` with a shipped `examples/ds_config_*.json`
(a 2-layer, dim-32 GPT, a few steps) and compares rank 0's logged loss at each step with
`gpt_reference.Reference`, a single-process run in this test on the same global batches.

Tolerances: fp32 runs agree to 1e-5 relative (ZeRO's partitioned reductions and the CPU Adam kernel only
change summation order); bf16 runs (bf16 forward/backward, fp32 master weights, fp32 cross-entropy) to
1e-3 relative: measured 6e-5 at worst over 6 steps, far below one bf16 rounding (3.9e-3) because the
loss averages 512 tokens' roundings; a run that silently trained in fp32 would still pass, one that lost
a step or its master weights would not.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from conftest import EXAMPLES, deepspeed, read_json_lines
from gpt_reference import Reference

LAYERS, DIM = 2, 32
FP32_RTOL, BF16_RTOL = 1e-5, 1e-3
SCRIPT = EXAMPLES / "train_gpt.py"


def _config(name: str) -> tuple[str, dict]:
    path = EXAMPLES / f"ds_config_{name}.json"
    return str(path), json.loads(path.read_text())


def _train(world: int, config: str, log: Path, *args: str, check: bool = True, timeout: float = 240):
    """Launch train_gpt.py on `world` ranks; returns (the finished process, rank 0's JSON log lines)."""
    proc = deepspeed(
        world,
        SCRIPT,
        "--deepspeed_config",
        config,
        "--layers",
        str(LAYERS),
        "--dim",
        str(DIM),
        "--log_json",
        str(log),
        *args,
        timeout=timeout,
        check=check,
    )
    return proc, (read_json_lines(log) if log.exists() else [])


def _losses(entries: list[dict]) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in entries if "loss" in e}


def _assert_trajectory(got: dict[int, float], want: list[float], steps: range, rtol: float) -> None:
    assert sorted(got) == list(steps), f"logged steps {sorted(got)}, expected {list(steps)}"
    expected = torch.tensor([want[s - 1] for s in steps], dtype=torch.float64)
    actual = torch.tensor([got[s] for s in steps], dtype=torch.float64)
    torch.testing.assert_close(
        actual,
        expected,
        rtol=rtol,
        atol=0.0,
        msg=lambda m: (
            f"loss trajectory differs from the reference:\n{m}\n"
            f"engine    {actual.tolist()}\nreference {expected.tolist()}"
        ),
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("name", "world", "rtol"),
    [
        ("zero0", 4, FP32_RTOL),
        ("offload", 2, FP32_RTOL),
        ("bf16", 2, BF16_RTOL),
        ("zero3", 2, FP32_RTOL),
    ],
)
def test_training_follows_plain_pytorch(tmp_path: Path, name: str, world: int, rtol: float) -> None:
    path, config = _config(name)
    _, log = _train(world, path, tmp_path / "log.jsonl", "--steps", "6", "--save_dir", str(tmp_path / "ckpt"))
    ref = Reference(config, LAYERS, DIM)
    ref.train(6, world)
    _assert_trajectory(_losses(log), ref.losses, range(1, 7), rtol)
    assert ref.losses[-1] < ref.losses[0]  # the comparison covers a run that learns


@pytest.mark.timeout(400)
def test_resume_zero1_checkpoint_under_zero2(tmp_path: Path) -> None:
    """ZeRO-1 trains 4 steps and saves; ZeRO-2 loads that checkpoint and continues the same trajectory."""
    (z1, config), (z2, _) = _config("zero1"), _config("zero2")
    save = str(tmp_path / "ckpt")
    _, first = _train(2, z1, tmp_path / "z1.jsonl", "--steps", "4", "--save_dir", save)
    _, second = _train(2, z2, tmp_path / "z2.jsonl", "--steps", "8", "--save_dir", save, "--load_dir", save)
    ref = Reference(config, LAYERS, DIM)
    ref.train(8, 2)
    _assert_trajectory(_losses(first), ref.losses, range(1, 5), FP32_RTOL)
    _assert_trajectory(_losses(second), ref.losses, range(5, 9), FP32_RTOL)


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """ZeRO-2 on 2 ranks, checkpoint every 2 steps; rank 1 exits with code 3 as step 5 begins."""
    out = tmp_path_factory.mktemp("killed")
    (out / "pids").mkdir()
    path, config = _config("zero2")
    proc, log = _train(
        2,
        path,
        out / "log.jsonl",
        "--steps",
        "8",
        "--save_every",
        "2",
        "--save_dir",
        str(out / "ckpt"),
        "--die_at_step",
        "5",
        "--die_rank",
        "1",
        "--die_code",
        "3",
        "--pid_dir",
        str(out / "pids"),
        check=False,
    )
    ended = time.time()
    return {"proc": proc, "log": log, "ended": ended, "dir": out, "config": config, "path": path}


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in state  # a zombie has exited


def test_killed_rank_ends_the_job_with_its_exit_code(killed_run: dict) -> None:
    proc, out = killed_run["proc"], killed_run["dir"]
    assert proc.returncode == 3, f"job exit code {proc.returncode}\n{proc.stderr[-3000:]}"
    died_at = float((out / "pids" / "died_at").read_text())
    assert killed_run["ended"] - died_at < 20, "the job outlived its dead rank by more than 20 s"
    pids = [int(p.read_text()) for p in (out / "pids").glob("rank*.pid")]
    assert len(pids) == 2
    assert not [pid for pid in pids if _alive(pid)], "a rank process outlived the job"
    assert (out / "ckpt" / "latest").read_text() == "global_step4"
    ref = Reference(killed_run["config"], LAYERS, DIM)
    ref.train(4, 2)
    _assert_trajectory(_losses(killed_run["log"]), ref.losses, range(1, 5), FP32_RTOL)


@pytest.mark.timeout(300)
def test_resume_killed_zero2_run_on_four_ranks(killed_run: dict, tmp_path: Path) -> None:
    """The last checkpoint of the 2-rank job loads into a 4-rank ZeRO-2 job, which continues the trajectory."""
    ckpt = str(killed_run["dir"] / "ckpt")
    _, log = _train(
        4,
        killed_run["path"],
        tmp_path / "log.jsonl",
        "--steps",
        "8",
        "--load_dir",
        ckpt,
        "--save_dir",
        str(tmp_path / "ckpt"),
    )
    ref = Reference(killed_run["config"], LAYERS, DIM)
    ref.train(4, 2)
    ref.train(4, 4)
    _assert_trajectory(_losses(log), ref.losses, range(5, 9), FP32_RTOL)


@pytest.mark.timeout(120)
def test_zero_to_fp32_gives_the_engines_eval_loss(killed_run: dict, tmp_path: Path) -> None:
    """`ds-zero-to-fp32` on the last checkpoint loads into the plain GPT and scores as the engine did."""
    import subprocess
    import sys

    out = tmp_path / "fp32"
    subprocess.run(
        [sys.executable, "-m", "ds_zero.zero_to_fp32", str(killed_run["dir"] / "ckpt"), str(out), "-q"],
        check=True,
        capture_output=True,
        timeout=120,
    )
    ref = Reference(killed_run["config"], LAYERS, DIM)
    ref.train(4, 2)
    model = ref.new_model()
    model.load_state_dict(torch.load(out / "pytorch_model.bin", weights_only=True))
    engine_eval = {e["step"]: e["eval_loss"] for e in killed_run["log"] if "eval_loss" in e}
    assert sorted(engine_eval) == [2, 4]
    assert ref.eval_loss(model) == pytest.approx(engine_eval[4], rel=1e-6)
    for name, param in ref.model.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], param, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.timeout(300)
def test_pipeline_2x2_follows_plain_pytorch(tmp_path: Path) -> None:
    """2 pipeline stages x 2 data-parallel replicas, 2 micro batches per step, tied embedding/head."""
    path, config = _config("pipeline")
    _, log = _train(
        4, path, tmp_path / "log.jsonl", "--steps", "5", "--pipeline_stages", "2", "--save_dir", str(tmp_path / "ckpt")
    )
    ref = Reference(config, LAYERS, DIM, shuffled=False)  # a PipelineEngine reads its data in order
    ref.train(5, 2, accumulation=config["gradient_accumulation_steps"])
    _assert_trajectory(_losses(log), ref.mean_losses, range(1, 6), FP32_RTOL)
    evals = [e["eval_loss"] for e in log if "eval_loss" in e]
    assert evals == [pytest.approx(ref.eval_loss(), rel=FP32_RTOL)]
