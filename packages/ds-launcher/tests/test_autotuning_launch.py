"""`deepspeed --autotuning tune|run` end to end through the launcher, with a stand-in script for the engine
(`fake_experiment.py`: it writes a metrics file from a fixed table, or fails like an out-of-memory run), so
the launcher's side is checked on its own: experiments launched one at a time with their own configs,
the files each leaves, the skipped sizes above a failure, `arg_mappings`, the optimal config and the
`run` job that trains with it. The real engine's side is tests-integration/test_autotuning.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ds_launcher.runner import parse_args

HERE = Path(__file__).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_autotuning_run_picks_the_best_and_trains_with_it(tmp_path: Path) -> None:
    config = {
        "train_micro_batch_size_per_gpu": [2, 4, 8, 16],
        "zero_optimization": {"stage": [0, 1]},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "autotuning": {
            "enabled": True,
            "arg_mappings": {"train_micro_batch_size_per_gpu": "--mbs_arg"},
            "metric_path": "one_file_for_all.json",  # replaced: each experiment writes in its own folder
        },
    }
    (tmp_path / "cfg.json").write_text(json.dumps(config))
    cmd = [sys.executable, "-m", "ds_launcher", "--autotuning", "run", "--num_gpus", "1", "--master_port"]
    cmd += [
        str(_free_port()),
        str(HERE / "fake_experiment.py"),
        "--deepspeed_config",
        "cfg.json",
        "--done_file",
        "done.json",
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr

    results = tmp_path / "autotuning_results"
    trials = json.loads((results / "trials.json").read_text())
    assert [(t["name"], t["status"]) for t in trials] == [
        ("z0_gas8_tmbspg2", "ok"),
        ("z0_gas4_tmbspg4", "ok"),
        ("z0_gas2_tmbspg8", "failed"),
        ("z0_gas1_tmbspg16", "skipped"),
        ("z1_gas8_tmbspg2", "ok"),
        ("z1_gas4_tmbspg4", "ok"),
        ("z1_gas2_tmbspg8", "failed"),
        ("z1_gas1_tmbspg16", "skipped"),
    ]
    best = results / "z1_gas4_tmbspg4"
    assert json.loads((best / "metrics.json").read_text())["throughput"] == 180.0
    exp_config = json.loads((best / "ds_config.json").read_text())
    assert exp_config["autotuning"]["enabled"] and exp_config["autotuning"]["metric_path"] == str(best / "metrics.json")
    assert "--mbs_arg 4" in (best / "cmd.txt").read_text()
    assert (tmp_path / "autotuning_exps" / "z1_gas4_tmbspg4.json").is_file()
    assert "out of memory" in (results / "z0_gas2_tmbspg8" / "stderr.log").read_text()
    assert not (results / "z0_gas1_tmbspg16").exists()

    optimal = json.loads((results / "ds_config_optimal.json").read_text())
    assert "autotuning" not in optimal
    assert optimal["zero_optimization"] == {"stage": 1}
    assert (optimal["train_micro_batch_size_per_gpu"], optimal["gradient_accumulation_steps"]) == (4, 4)
    assert optimal["train_batch_size"] == 16 and optimal["optimizer"] == config["optimizer"]
    assert "ds_config_optimal.json" in (results / "cmd_optimal.txt").read_text()
    summary = (results / "summary.txt").read_text()
    assert "| global       | 6               | 180             | z1_gas4_tmbspg4 |" in summary
    assert "Tuning completed in" in summary
    assert json.loads((tmp_path / "done.json").read_text()) == optimal  # `run` trained with it


def test_autotuning_refuses_bad_settings_before_any_experiment(tmp_path: Path) -> None:
    (tmp_path / "cfg.json").write_text(json.dumps({"autotuning": {"tuner_type": "bayes"}}))
    cmd = [sys.executable, "-m", "ds_launcher", "--autotuning", "tune", "--num_gpus", "1", "x.py"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [*cmd, "--deepspeed_config", "cfg.json"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert "autotuning.tuner_type: Input should be 'gridsearch', 'random' or 'model_based'" in proc.stderr
    assert not (tmp_path / "autotuning_results").exists()


def test_command_line() -> None:
    for option in ("tune", "run"):
        assert parse_args(["--num_gpus", "1", "--autotuning", option, "foo.py"]).autotuning == option
    for bad in (["--autotuning", "--num_gpus", "1", "foo.py"], ["--autotuning", "test", "foo.py"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
