"""`deepspeed --autotuning tune|run` with the real engine: experiments of a tiny model at 2 CPU ranks over
ZeRO stage 1 x micro-batch sizes 2 and 4 (2 profiled steps each; the stage x size cross product is the
launcher's unit tests' job), the per-experiment metrics the
engines wrote, `ds_config_optimal.json`, and `--autotuning run` training with it; then the path that
measures the model first (the model profile experiment) at 1 rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import free_port_run

SCRIPT = Path(__file__).parent / "autotuning" / "tiny_train.py"
BASE = {
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
}


def _autotune(tmp_path: Path, mode: str, num_gpus: int, config: dict) -> subprocess.CompletedProcess[str]:
    (tmp_path / "cfg.json").write_text(json.dumps(config))
    cmd = [sys.executable, "-m", "ds_launcher", "--autotuning", mode, "--num_gpus", str(num_gpus)]
    cmd += ["--master_port", str(free_port_run(16)), str(SCRIPT), "--deepspeed_config", "cfg.json", "--steps", "4"]
    cmd += ["--done_file", "done.json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return proc


@pytest.mark.timeout(600)
def test_tune_then_run_with_the_optimal_config(tmp_path: Path) -> None:
    config = {
        **BASE,
        "train_micro_batch_size_per_gpu": [2, 4],
        "zero_optimization": {"stage": [1]},
        "autotuning": {"enabled": True, "start_profile_step": 1, "end_profile_step": 2},
    }
    _autotune(tmp_path, "run", 2, config)
    results = tmp_path / "autotuning_results"
    names = ["z1_gas2_tmbspg2", "z1_gas1_tmbspg4"]
    throughput = {}
    for name in names:
        metrics = json.loads((results / name / "metrics.json").read_text())
        assert metrics["num_profiled_steps"] == 2 and metrics["train_batch_size"] == 8
        assert metrics["throughput"] == pytest.approx(8 / (metrics["latency"] / 1e3))
        assert metrics["FLOPS_per_gpu"] > 0
        throughput[name] = metrics["throughput"]
    best = max(throughput, key=throughput.__getitem__)
    optimal = json.loads((results / "ds_config_optimal.json").read_text())
    assert "autotuning" not in optimal
    chosen = json.loads((results / best / "ds_config.json").read_text())
    chosen.pop("autotuning")
    assert optimal == chosen
    assert best in (results / "summary.txt").read_text().splitlines()[-3]  # the "global" row
    done = json.loads((tmp_path / "done.json").read_text())  # written by the `run` job after its 4 steps
    assert done == {
        "steps": 4,
        "train_micro_batch_size_per_gpu": optimal["train_micro_batch_size_per_gpu"],
        "gradient_accumulation_steps": optimal["gradient_accumulation_steps"],
        "zero_stage": optimal["zero_optimization"]["stage"],
    }


@pytest.mark.timeout(300)
def test_the_model_profile_bounds_the_micro_batch_sizes(tmp_path: Path) -> None:
    config = {
        **BASE,
        "train_micro_batch_size_per_gpu": 2,
        "autotuning": {
            "enabled": True,
            "start_profile_step": 0,
            "end_profile_step": 1,
            "num_tuning_micro_batch_sizes": 2,
        },
    }
    _autotune(tmp_path, "tune", 1, config)
    results = tmp_path / "autotuning_results"
    info = json.loads((results / "profile_model_info" / "model_info.json").read_text())
    assert info["num_params"] == 16 * 32 + 32 + 32 + 1
    assert info["activation_mem_per_gpu"] == (16 + 32) * 4  # one sample: l1's input and tanh's output, fp32
    trials = json.loads((results / "trials.json").read_text())
    assert [t["name"] for t in trials] == ["z0_gas2_tmbspg2", "z0_gas1_tmbspg4"]
    assert not (tmp_path / "done.json").exists()  # `tune` does not train
