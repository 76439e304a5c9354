"""`ds-engine explain` / `python -m ds_engine.explain`: resolved config, batch provenance, the wrapper chain."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ds_engine.explain import cli, main

CONFIG = {
    "train_batch_size": 64,
    "gradient_accumulation_steps": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100}},
    "bf16": {"enabled": True},
    "gradient_clipping": 0.5,
}


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(CONFIG))
    return path


def test_explain_shows_batch_sources_chain_autos_and_defaults(config_file: Path, capsys) -> None:
    assert main([str(config_file), "--world-size", "4", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "data-parallel world size: 4 (given)" in out
    assert "train_batch_size                      64   given" in out
    assert (
        "train_micro_batch_size_per_gpu         4   derived: train_batch_size / (gradient_accumulation_steps x "
        "world size) = 64 / (4 x 4)"
    ) in out
    assert "base optimizer: torch.optim.AdamW(" in out and "torch_adam=true" in out
    assert "wrapper: MixedPrecisionOptimizer (bf16 parameters, fp32 master weights)" in out
    assert "gradient accumulation in bfloat16; clip global norm: 0.5" in out
    assert "data parallel: bucketed all-reduce (mean over 4 ranks" in out
    assert "lr scheduler: WarmupLR(warmup_num_steps=100)" in out and "engine: DeepSpeedEngine" in out
    assert 'unfilled "auto" placeholders' in out and "  optimizer.params.lr" in out
    lines = {
        line.split()[0]: line.split()[-1]
        for line in out.splitlines()
        if line.startswith("  ") and len(line.split()) >= 3
    }
    assert lines["bf16.enabled"] == "set" and lines["fp16.enabled"] == "default"
    assert lines["gradient_clipping"] == "set" and lines["steps_per_print"] == "default"
    assert lines["train_micro_batch_size_per_gpu"] == "derived"


def test_auto_values_fill_from_the_command_line(config_file: Path, capsys) -> None:
    assert cli(["explain", str(config_file), "--auto", "optimizer.params.lr=0.0003"]) == 0
    out = capsys.readouterr().out
    assert "lr=0.0003" in out and "unfilled" not in out


def test_bad_config_exits_2_with_the_key(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"train_batch_size": 8, "fp16": {"enabled": True, "loss_scale_windw": 3}}))
    assert main([str(bad)]) == 2
    assert "fp16.loss_scale_windw: unknown key" in capsys.readouterr().err
    assert cli(["explian", str(bad)]) == 2


def test_module_entry_point_runs(config_file: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ds_engine.explain", str(config_file), "--world-size", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "train_micro_batch_size_per_gpu         8   derived" in proc.stdout


@pytest.mark.skipif(importlib.util.find_spec("ds_zero") is None, reason="bf16 masters: needs ds-zero")
def test_explain_names_bf16_master_weights(tmp_path: Path, capsys) -> None:
    config = {
        **CONFIG,
        "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
        "zero_optimization": {"stage": 3},
    }
    path = tmp_path / "bf16_full.json"
    path.write_text(json.dumps(config))
    assert main([str(path), "--world-size", "2", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "master weights, gradient partitions and optimizer states in bf16 on the device (8 bytes" in out
    config["zero_optimization"] = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    path.write_text(json.dumps(config))
    assert main([str(path), "--world-size", "2", "--device", "cpu"]) == 2  # torch_adam: torch's AdamW cannot
    assert "with optimizer offload needs DeepSpeedCPUAdam" in capsys.readouterr().err  # step bf16 host masters
    config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    path.write_text(json.dumps(config))
    assert main([str(path), "--world-size", "2", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "optimizer states in bf16 on the CPU, stepped by DeepSpeedCPUAdam (8 bytes" in out
    assert "fp32_optimizer_states': False" in out or "moments in bf16 (bf16.bf16_optimizer_states)" in out
    config["bf16"] = {"enabled": True, "bf16_master_weights_and_grads": True}
    path.write_text(json.dumps(config))
    assert main([str(path), "--world-size", "2", "--device", "cpu"]) == 0
    assert "Adam moments fp32 (12 bytes per partitioned element" in capsys.readouterr().out
    config["zero_optimization"] = {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}
    path.write_text(json.dumps(config))  # DeepSpeed pages bf16 masters from NVMe too
    assert main([str(path), "--world-size", "2", "--device", "cpu"]) == 0
    assert "master weights and gradient partitions in bf16 on NVMe (swap files" in capsys.readouterr().out
    config["bf16"] = {"enabled": True}
    path.write_text(json.dumps(config))
    assert main([str(path), "--world-size", "2", "--device", "cpu"]) == 0
    assert "optimizer states in bf16" not in capsys.readouterr().out


@pytest.mark.parametrize(("stage", "expected"), [(3, "pass z3: each partitioned parameter"), (2, "pass z1:")])
def test_explain_shows_deepcompile_passes(tmp_path: Path, capsys, stage: int, expected: str) -> None:
    pytest.importorskip("ds_zero")  # the ZeRO stage's plan, which names the pass, needs ds-zero
    config = {**CONFIG, "zero_optimization": {"stage": stage}, "compile": {"deepcompile": True, "debug_log": True}}
    path = tmp_path / "dc.json"
    path.write_text(json.dumps(config))
    assert main([str(path), "--world-size", "2", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "DeepCompile (compile.deepcompile)" in out and expected in out
    assert ("selective unsharding: after 5 warm-up steps" in out) == (stage == 3)
    steps = "step 0: zero3_compile, prefetch; step 5: zero3_compile, prefetch, selective_gather"
    steps = steps if stage == 3 else f"step 0: zero{stage}_compile"
    assert f"pass schedule unless engine.compile(schedule=...) gives one: {steps}" in out, out
    assert "logged at INFO" in out
    config["compile"] = {"deepcompile": False}
    path.write_text(json.dumps(config))
    assert main([str(path), "--world-size", "2", "--device", "cpu"]) == 0
    assert "DeepCompile (compile.deepcompile)" not in capsys.readouterr().out
