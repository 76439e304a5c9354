"""Optimizer choice from the config (Adam routing, names, params), Lion and Lamb against their update rules."""

from __future__ import annotations

import pytest
import torch
from ds_engine_testkit import base_config, batches, flat_params, loss_fn, make_engine, tiny_net

import ds_engine
import ds_ops
from ds_engine._optim.optimizers import normalize_param_groups, plan_config_optimizer, swap_for_cpu_optimizer
from ds_engine._optim.torch_optimizers import FusedLion


class FakeCPUAdam(torch.optim.AdamW):
    """Stands in for ds_ops.DeepSpeedCPUAdam (contract signature) where the real one is not installed."""

    def __init__(
        self,
        model_params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0,
        amsgrad=False,
        adamw_mode=True,
        fp32_optimizer_states=True,
    ):
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.adamw_mode = adamw_mode


FakeCPUAdam.__name__ = "DeepSpeedCPUAdam"


@pytest.fixture
def no_cpu_adam(monkeypatch):
    monkeypatch.delattr(ds_ops, "DeepSpeedCPUAdam", raising=False)


@pytest.fixture
def no_fused_adam(monkeypatch):
    monkeypatch.delattr(ds_ops, "FusedAdam", raising=False)


@pytest.fixture
def fake_cpu_adam(monkeypatch):
    monkeypatch.setattr(ds_ops, "DeepSpeedCPUAdam", FakeCPUAdam, raising=False)


def test_torch_adam_and_adam_w_mode(no_cpu_adam) -> None:
    plan = plan_config_optimizer(
        "adam", {"lr": 0.1, "torch_adam": True, "adam_w_mode": False}, device_type="cpu", offload=False
    )
    assert (plan.target, plan.kwargs) == ("torch.optim.Adam", {"lr": 0.1})
    plan = plan_config_optimizer("adam", {"lr": 0.1, "torch_adam": True}, device_type="cpu", offload=False)
    assert plan.target == "torch.optim.AdamW"  # "Adam" means AdamW unless adam_w_mode is false, as in DeepSpeed
    plan = plan_config_optimizer("adamw", {"torch_adam": True, "adam_w_mode": False}, device_type="cpu", offload=False)
    assert plan.target == "torch.optim.AdamW"


def test_torch_adam_stays_torch_under_offload(caplog) -> None:
    """DeepSpeed: `torch_adam` wins over offload, and `fp32_optimizer_states` is dropped (popped) there."""
    params = {"lr": 0.1, "torch_adam": True, "adam_w_mode": False, "fp32_optimizer_states": True}
    with caplog.at_level("WARNING", logger="ds_engine._optim.optimizers"):
        plan = plan_config_optimizer("adam", params, device_type="cpu", offload=True)
    assert (plan.target, plan.kwargs) == ("torch.optim.Adam", {"lr": 0.1})
    assert "fp32_optimizer_states applies to ds_ops.DeepSpeedCPUAdam" in caplog.text
    with pytest.raises(ValueError, match="bias_correction does not apply with torch_adam=true"):
        plan_config_optimizer("adam", {"torch_adam": True, "bias_correction": True}, device_type="cpu", offload=True)


def test_default_adam_path_by_device(no_fused_adam) -> None:
    cpu = plan_config_optimizer("adamw", {"lr": 0.1}, device_type="cpu", offload=False)
    assert cpu.target == "torch.optim.AdamW" and cpu.kwargs == {"lr": 0.1, "weight_decay": 0.0, "foreach": True}
    assert "ds_ops.FusedAdam not available" in cpu.note
    cuda = plan_config_optimizer("adam", {"lr": 0.1, "weight_decay": 0.1}, device_type="cuda", offload=False)
    assert cuda.kwargs == {"lr": 0.1, "weight_decay": 0.1, "fused": True}
    with pytest.raises(ValueError, match="bias_correction=false needs ds_ops.FusedAdam or ds_ops.DeepSpeedCPUAdam"):
        plan_config_optimizer("adam", {"bias_correction": False}, device_type="cuda", offload=False)


def test_offload_needs_cpu_adam(no_cpu_adam) -> None:
    with pytest.raises(ValueError, match="offload_optimizer needs ds_ops.DeepSpeedCPUAdam"):
        plan_config_optimizer("adam", {}, device_type="cuda", offload=True)
    with pytest.raises(ValueError, match="offload_optimizer needs ds_ops.DeepSpeedCPUAdam"):
        plan_config_optimizer("adam", {}, device_type="cpu", offload=True)


def test_cpu_parameters_get_fused_adam_and_offload_gets_cpu_adam(fake_cpu_adam, caplog) -> None:
    """DeepSpeed on a CPU host: FusedAdam (its CPU fused-adam kernel) without offload, DeepSpeedCPUAdam with."""
    params = {"lr": 0.1, "adam_w_mode": False, "bias_correction": True, "set_grad_none": False}
    plan = plan_config_optimizer("adam", params, device_type="cpu", offload=False)
    assert plan.target == "ds_ops.FusedAdam"
    assert plan.kwargs == {"lr": 0.1, "bias_correction": True, "set_grad_none": False, "adam_w_mode": False}
    assert plan.fallback is not None and plan.fallback.target == "torch.optim.Adam"
    assert plan.fallback.kwargs == {"lr": 0.1, "weight_decay": 0.0, "foreach": True}
    offload = plan_config_optimizer("adam", params, device_type="cpu", offload=True)
    assert offload.target == "ds_ops.DeepSpeedCPUAdam" and offload.fallback is None
    assert offload.kwargs == {"lr": 0.1, "bias_correction": True, "adamw_mode": False}
    with caplog.at_level("WARNING", logger="ds_engine._optim.optimizers"):
        dropped = plan_config_optimizer("adamw", {"fp32_optimizer_states": False}, device_type="cpu", offload=False)
    assert dropped.kwargs == {"adam_w_mode": True} and "ds_ops.FusedAdam ignores it" in caplog.text
    kept = plan_config_optimizer("adamw", {"fp32_optimizer_states": False}, device_type="cpu", offload=True)
    assert kept.kwargs == {"fp32_optimizer_states": False, "adamw_mode": True}
    no_fallback = plan_config_optimizer("adam", {"bias_correction": False}, device_type="cpu", offload=False)
    assert no_fallback.target == "ds_ops.FusedAdam" and no_fallback.fallback is None
    engine = make_engine(tiny_net(0), base_config(optimizer={"type": "AdamW", "params": {"lr": 0.1}}))
    assert type(engine.optimizer) is ds_ops.FusedAdam and engine.optimizer.adam_w_mode is True
    with pytest.raises(ValueError, match=r"\['foreach'\] are not arguments of ds_ops.FusedAdam"):
        plan_config_optimizer("adam", {"foreach": True}, device_type="cpu", offload=False)
    with pytest.raises(ValueError, match=r"\['foreach'\] are not arguments of ds_ops.DeepSpeedCPUAdam"):
        plan_config_optimizer("adam", {"foreach": True, "set_grad_none": True}, device_type="cpu", offload=True)
    with pytest.raises(ValueError, match="amsgrad=true: ds_ops.FusedAdam"):
        plan_config_optimizer("adam", {"amsgrad": True}, device_type="cpu", offload=False)


def test_fused_adam_that_fails_to_load_falls_back_to_torch(monkeypatch) -> None:
    class Broken:
        def __init__(self, *args, **kwargs):
            raise RuntimeError("the fused_adam CPU kernel failed to compile")

    monkeypatch.setattr(ds_ops, "FusedAdam", Broken, raising=False)
    engine = make_engine(tiny_net(0), base_config(optimizer={"type": "Adam", "params": {"lr": 0.1}}))
    assert type(engine.optimizer) is torch.optim.AdamW and engine.optimizer.defaults["weight_decay"] == 0.0


def test_real_fused_adam_matches_torch_adamw() -> None:
    """5 steps of the config AdamW (FusedAdam on CPU) against torch's AdamW: rtol=1e-5, atol=1e-6."""
    ref = tiny_net(0)
    ref_engine = make_engine(
        ref, base_config(optimizer={"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True, "weight_decay": 0.0}})
    )
    model = tiny_net(0)
    engine = make_engine(model, base_config(optimizer={"type": "AdamW", "params": {"lr": 1e-2}}))
    assert type(engine.optimizer) is ds_ops.FusedAdam
    for x, y in batches(5, 4):
        for e in (ref_engine, engine):
            e.backward(loss_fn(e(x), y))
            e.step()
    torch.testing.assert_close(flat_params(model), flat_params(ref), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("SGD", torch.optim.SGD),
        ("RMSprop", torch.optim.RMSprop),
        ("adagrad", torch.optim.Adagrad),
        ("Lion", FusedLion),
        ("LAMB", ds_engine.Lamb),
    ],
)
def test_optimizers_by_name(name, cls) -> None:
    engine = make_engine(tiny_net(0), base_config(optimizer={"type": name, "params": {"lr": 0.01}}))
    assert type(engine.optimizer) is cls
    for x, y in batches(2, 4):
        engine.backward(loss_fn(engine(x), y))
        engine.step()


def test_lion_follows_its_update_rule() -> None:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5))
    opt = ds_engine.Lion([p], lr=0.1, betas=(0.9, 0.99), weight_decay=0.5)
    w, m = p.detach().clone(), torch.zeros(5)
    for _ in range(4):
        g = torch.randn(5)
        p.grad = g.clone()
        opt.step()
        w = w * (1 - 0.1 * 0.5) - 0.1 * torch.sign(0.9 * m + 0.1 * g)
        m = 0.99 * m + 0.01 * g
        torch.testing.assert_close(p.detach(), w)


def test_lamb_follows_its_update_rule() -> None:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(6))
    opt = ds_engine.Lamb([p], lr=0.05, weight_decay=0.01, max_coeff=10.0, min_coeff=0.01)
    w, m, v = p.detach().clone(), torch.zeros(6), torch.zeros(6)
    for t in range(1, 5):
        g = torch.randn(6)
        p.grad = g.clone()
        opt.step()
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        update = (m / (1 - 0.9**t)) / ((v / (1 - 0.999**t)).sqrt() + 1e-8) + 0.01 * w
        trust = min(max(float(w.norm() / update.norm()), 0.01), 10.0)
        w = w - 0.05 * trust * update
        torch.testing.assert_close(p.detach(), w)
    with pytest.raises(ValueError, match="amsgrad=True is not supported"):
        ds_engine.Lamb([p], amsgrad=True)


def test_client_optimizer_swap_for_offload(fake_cpu_adam) -> None:
    model = tiny_net(0)
    swapped = swap_for_cpu_optimizer(torch.optim.Adam(model.parameters(), lr=0.3, weight_decay=0.1), force=True)
    assert isinstance(swapped, FakeCPUAdam) and swapped.defaults["lr"] == 0.3 and swapped.adamw_mode is False
    with pytest.raises(ValueError, match="offload_optimizer needs a DeepSpeed CPU optimizer, got a client SGD"):
        swap_for_cpu_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), force=True)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    assert swap_for_cpu_optimizer(sgd, force=False) is sgd


def test_param_groups_are_normalized() -> None:
    model = tiny_net(0)
    groups = normalize_param_groups([{"params": model.l1.weight}, {"params": []}, model.l2.bias], model)
    assert len(groups) == 2 and groups[0]["params"] == [model.l2.bias]
    with pytest.raises(ValueError, match="more than one entry"):
        normalize_param_groups([model.l1.weight, {"params": [model.l1.weight]}], model)
    with pytest.raises(TypeError, match="needs a 'params' key"):
        normalize_param_groups([{"lr": 1.0}], model)


def test_config_torch_adam_is_not_swapped_under_offload() -> None:
    """DeepSpeed swaps (or refuses) client optimizers under offload; `torch_adam: true` stays torch's AdamW."""
    pytest.importorskip("ds_zero", reason="optimizer offload needs ds-zero: pip install 'ds-engine[zero]'")
    offload = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    engine = make_engine(tiny_net(0), base_config(zero_optimization=offload))
    assert type(engine.optimizer.optimizer) is torch.optim.AdamW and engine.zero_cpu_offload()
    model = tiny_net(0)
    client = torch.optim.AdamW(model.parameters(), lr=0.1)
    swapped = make_engine(model, base_config(zero_optimization=offload, optimizer=None), optimizer=client)
    assert type(swapped.optimizer.optimizer) is ds_ops.DeepSpeedCPUAdam


def test_lion_config_defaults_are_deepspeeds_with_and_without_offload() -> None:
    """DeepSpeed's FusedLion and CPU Lion both default to lr 1e-3, betas (0.9, 0.999): so must the config."""
    engine = make_engine(tiny_net(0), base_config(optimizer={"type": "Lion", "params": {}}))
    assert isinstance(engine.optimizer, FusedLion) and isinstance(engine.optimizer, ds_engine.Lion)
    cpu = ds_ops.DeepSpeedCPULion([torch.nn.Parameter(torch.zeros(2))])
    for key in ("lr", "betas", "weight_decay"):
        assert engine.optimizer.defaults[key] == cpu.defaults[key], key
    assert engine.optimizer.defaults["lr"] == 1e-3 and tuple(engine.optimizer.defaults["betas"]) == (0.9, 0.999)
    assert FusedLion.__module__ == "ds_engine._optim.torch_optimizers"
    from ds_engine.ops.lion import FusedLion as from_ops_path

    assert from_ops_path is FusedLion


def test_offloaded_bf16_optimizer_states_build_cpu_adam_with_bf16_moments(caplog: pytest.LogCaptureFixture) -> None:
    """As DeepSpeed's engine: `bf16.bf16_optimizer_states` under offload overrides `fp32_optimizer_states` to false."""
    params = {"lr": 1e-3, "fp32_optimizer_states": True}
    with caplog.at_level("WARNING"):
        plan = plan_config_optimizer("adamw", params, device_type="cpu", offload=True, bf16_optimizer_states=True)
    assert plan.target == "ds_ops.DeepSpeedCPUAdam" and plan.kwargs["fp32_optimizer_states"] is False
    assert "overrides optimizer.params.fp32_optimizer_states=true" in caplog.text
    plain = plan_config_optimizer("adamw", params, device_type="cpu", offload=True)
    assert plain.kwargs["fp32_optimizer_states"] is True
