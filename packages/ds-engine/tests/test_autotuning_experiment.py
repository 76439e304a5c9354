"""An autotuning experiment in the engine: the timed window, the metrics file, the exit, the model profile.

The timing is checked against sleeps of known length: inside the forward they are counted, between
the steps (the script's own time) they are not. The flops of a step are checked against the matrix
multiplies of a two-layer MLP's forward and backward, to the elementwise work's 10% margin.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from ds_engine_testkit import base_config, batches, loss_fn, make_engine, tiny_net
from torch import nn

from ds_engine.config import DeepSpeedConfig
from ds_engine.explain import explain

SLEEP_S = 0.02


class SleepyNet(nn.Module):
    """TinyNet's layers with a fixed sleep in every forward (a step of known minimum length), and a long one in
    forward number `slow_call` (a step slowed by something else on the host)."""

    def __init__(self, slow_call: int = -1) -> None:
        super().__init__()
        self.net = tiny_net()
        self.calls = 0
        self.slow_call = slow_call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(SLEEP_S + (0.3 if self.calls == self.slow_call else 0.0))
        self.calls += 1
        return self.net(x)


def _train_until_exit(engine, *, gap_s: float = 0.0, max_steps: int = 20) -> int:
    data = batches(max_steps * engine.gradient_accumulation_steps(), 4)
    with pytest.raises(SystemExit) as exited:
        for x, y in data:
            engine.backward(loss_fn(engine(x), y))
            engine.step()
            if engine.micro_steps % engine.gradient_accumulation_steps() == 0:
                time.sleep(gap_s)  # the script's own time between optimizer steps
    assert exited.value.code == 0
    return engine.global_steps


def test_experiment_times_the_window_writes_the_metrics_and_exits(tmp_path: Path) -> None:
    metric_path = tmp_path / "exp" / "metrics.json"
    autotuning = {"enabled": True, "start_profile_step": 1, "end_profile_step": 3, "metric_path": str(metric_path)}
    model = SleepyNet(slow_call=5)  # the second forward of step 2
    engine = make_engine(model, base_config(gradient_accumulation_steps=2, autotuning=autotuning))
    assert engine.autotuning_enabled() and engine.autotuning_metric_path() == str(metric_path)

    steps = _train_until_exit(engine, gap_s=0.1)

    assert steps == 4  # steps 0-3 ran; the process ends after the last timed one
    metrics = json.loads(metric_path.read_text())
    assert metrics["num_profiled_steps"] == 3
    assert metrics["train_batch_size"] == 8
    # two forwards of >= 20 ms per step are counted, the 100 ms between steps is not; the median leaves out
    # the step slowed by 300 ms, the mean does not
    assert 2 * SLEEP_S * 1e3 <= metrics["latency"] < 2 * SLEEP_S * 1e3 + 60
    assert metrics["latency_mean"] >= 2 * SLEEP_S * 1e3 + 300 / 3
    assert metrics["throughput"] == pytest.approx(8 / (metrics["latency"] / 1e3), rel=1e-9)
    flops_per_step = metrics["FLOPS_per_gpu"] * metrics["latency"] / 1e3
    # per sample: forward 2 x weights, weight gradients 2 x weights, input gradient of l2 only (the data needs
    # none) 2 x its weights; 4 samples per micro-batch, 2 micro-batches
    matmul_flops = (4 * (8 * 16 + 16 * 4) + 2 * 16 * 4) * 4 * 2
    assert matmul_flops <= flops_per_step <= 1.1 * matmul_flops
    assert metrics["flops"] == metrics["FLOPS_per_gpu"]


def test_window_from_step_zero_and_default_metric_path(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    autotuning = {"enabled": True, "start_profile_step": 0, "end_profile_step": 0}
    engine = make_engine(tiny_net(), base_config(autotuning=autotuning))
    assert _train_until_exit(engine) == 1
    metrics = json.loads((tmp_path / "autotuning_metric.json").read_text())
    assert metrics["num_profiled_steps"] == 1 and metrics["latency"] > 0


def test_model_info_profile_counts_parameters_and_saved_activations(tmp_path: Path) -> None:
    path = tmp_path / "model_info.json"
    autotuning = {"enabled": True, "model_info": {"profile": True}, "model_info_path": str(path)}
    engine = make_engine(tiny_net(), base_config(autotuning=autotuning))
    assert engine.autotuning_profile_model_info()
    x = torch.randn(4, 8)
    with pytest.raises(SystemExit):
        engine(x)
    info = json.loads(path.read_text())
    assert info["num_params"] == info["trainable_num_params"] == 8 * 16 + 16 + 16 * 4 + 4
    # autograd keeps the input of l1 (4x8) and tanh's output, which is also l2's input (4x16), in fp32
    assert info["activation_mem_per_gpu"] == (4 * 8 + 4 * 16) * 4


def test_switched_off_the_engine_trains_on() -> None:
    engine = make_engine(
        tiny_net(), base_config(autotuning={"enabled": False, "start_profile_step": 0, "end_profile_step": 0})
    )
    for x, y in batches(3, 4):
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    assert engine.global_steps == 3 and not engine.autotuning_enabled()


def test_explain_shows_the_experiment() -> None:
    config = DeepSpeedConfig(base_config(autotuning={"enabled": True, "metric": "latency", "metric_path": "m.json"}))
    text = explain(config, device_type="cpu")
    assert "autotuning experiment (autotuning.enabled)" in text
    assert "optimizer steps 3..5 timed; the latency metrics written to m.json" in text
