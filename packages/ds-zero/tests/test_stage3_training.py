"""Stage-3 training and evaluation in one process (world size 1): exact against plain torch, and the edges.

Covers what needs no second rank: the gather/release schedule on a model with tied weights and a
module called twice, outputs the hooks cannot see (the saved-tensor safety net re-gathers in
backward), evaluation without an optimizer, fp16 overflow skipping, and the optimizer's argument errors.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import ds_zero
from ds_ops.precision import DynamicLossScaler
from ds_zero import GatheredParameters, ZeroParamStatus


class Opaque:
    """A container pytree does not know: forward hooks cannot find the tensor inside."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 16)
        self.l1 = nn.Linear(16, 32)
        self.l2 = nn.Linear(32, 16)
        self.head = nn.Linear(16, 40, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.l1(self.emb(x)))
        h = self.l2(h) + self.l2(h * 0.5)  # l2 runs twice
        return self.head(torch.tanh(h))


class OpaqueLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> Opaque:  # type: ignore[override]
        return Opaque(super().forward(x))


class OpaqueNet(Net):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = OpaqueLinear(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.l1(self.emb(x)).value)
        return self.head(torch.tanh(self.l2(h)))


CFG = {
    "stage": 3,
    "stage3_param_persistence_threshold": 20,
    "stage3_prefetch_bucket_size": 600,
    "stage3_max_live_parameters": 1200,
    "stage3_max_reuse_distance": 600,
}


def _train(model: nn.Module, steps: int = 6, wrap: bool = True) -> tuple[list[float], nn.Module]:
    torch.manual_seed(1)
    base = torch.optim.Adam(model.parameters(), lr=1e-2)
    opt = ds_zero.DeepSpeedZeroOptimizer_Stage3(model, base, config=CFG, clip_grad=0.5) if wrap else None
    losses = []
    for _ in range(steps):
        x = torch.randint(0, 40, (4, 7))
        loss = model(x).pow(2).mean()
        if opt is None:
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            base.step()
            base.zero_grad()
        else:
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    return losses, model


@pytest.mark.parametrize("cls", [Net, OpaqueNet])
def test_single_rank_training_equals_plain_torch(cls: type[nn.Module], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="ds_zero")
    torch.manual_seed(0)
    ref = cls()
    model = copy.deepcopy(ref)
    ours, model = _train(model)
    theirs, ref = _train(ref, wrap=False)
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), atol=1e-6, rtol=1e-5)
    with GatheredParameters(model.parameters()):
        for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, r, atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    assert all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE or p.ds_persist for p in model.parameters())
    # an output the hooks cannot see: backward re-gathers l1's weight through the saved-tensor hooks
    assert ("backward needed l1.weight" in caplog.text) == (cls is OpaqueNet)


def test_evaluation_without_optimizer_and_under_inference_mode() -> None:
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    offload = ds_zero.DeepSpeedZeRoOffload(model, config={"stage3_param_persistence_threshold": 0})
    x = torch.randint(0, 40, (3, 5))
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), atol=0, rtol=0)
        torch.testing.assert_close(model(x), ref(x), atol=0, rtol=0)  # replays the recorded eval trace
    with torch.inference_mode():
        torch.testing.assert_close(model(x), ref(x), atol=0, rtol=0)
    assert all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in model.parameters())
    assert offload.peak_live_numel > 0
    with pytest.raises(ValueError, match="already has stage-3 parameter management"):
        ds_zero.DeepSpeedZeRoOffload(model)


def test_fp16_overflow_skips_the_step_and_lowers_the_scale() -> None:
    torch.manual_seed(0)
    model = Net().half()
    scaler = DynamicLossScaler(init_scale=2.0**8, delayed_shift=1)
    opt = ds_zero.DeepSpeedZeroOptimizer_Stage3(
        model, torch.optim.SGD(model.parameters(), lr=0.1), config={"stage": 3}, loss_scaler=scaler
    )
    with GatheredParameters(model.parameters()):
        before = [p.detach().clone() for p in model.parameters()]
    loss = model(torch.randint(0, 40, (2, 3))).float().mean() * float("inf")
    opt.backward(loss)
    assert opt.step() is False and opt.loss_scale == 2.0**7
    with GatheredParameters(model.parameters()):
        for p, b in zip(model.parameters(), before, strict=True):
            torch.testing.assert_close(p, b, atol=0, rtol=0)
    opt.backward(model(torch.randint(0, 40, (2, 3))).float().mean())
    assert opt.step() is True and opt.global_grad_norm is not None and opt.global_grad_norm > 0


def test_optimizer_argument_errors() -> None:
    model = Net()
    with pytest.raises(ValueError, match="stage=3, got 2"):
        ds_zero.DeepSpeedZeroOptimizer_Stage3(model, torch.optim.SGD(model.parameters(), lr=0.1), config={"stage": 2})
    stray = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="not a parameter of the module"):
        ds_zero.DeepSpeedZeroOptimizer_Stage3(model, torch.optim.SGD([*model.parameters(), stray], lr=0.1))
    with pytest.raises(ValueError, match="offload_optimizer.nvme_path='/no/such/dir': the directory does not exist"):
        ds_zero.DeepSpeedZeroOptimizer_Stage3(
            Net(),
            torch.optim.SGD(Net().parameters(), lr=0.1),
            config={"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/no/such/dir"}},
        )
    other = Net()
    used = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    other(torch.randint(0, 40, (1, 2))).sum().backward()
    used.step()
    with pytest.raises(ValueError, match="already has state"):
        ds_zero.DeepSpeedZeroOptimizer_Stage3(other, used)
    wrapped = Net()
    ds_zero.DeepSpeedZeroOptimizer_Stage3(wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="before building DeepSpeedZeroOptimizer_Stage3"):
        wrapped.to(torch.bfloat16)


class CheckpointedNet(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 48), nn.ReLU(), nn.Linear(48, 16)) for _ in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(x)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_recomputes_with_gathered_parameters(reentrant: bool) -> None:
    torch.manual_seed(0)
    ref = CheckpointedNet(reentrant)
    model = copy.deepcopy(ref)
    opt = ds_zero.DeepSpeedZeroOptimizer_Stage3(
        model,
        torch.optim.Adam(model.parameters(), lr=1e-2),
        config={"stage": 3, "stage3_param_persistence_threshold": 0},
    )
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for _ in range(3):
        x = torch.randn(5, 16, requires_grad=reentrant)
        loss = model(x).pow(2).mean()
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        ref(x).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    with GatheredParameters(model.parameters()):
        for p, r in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, r, atol=1e-6, rtol=1e-5)


def test_both_calling_conventions_and_their_errors() -> None:
    a, b = Net(), Net()
    ds_zero.DeepSpeedZeroOptimizer_Stage3(a, torch.optim.SGD(a.parameters(), lr=0.1), config={"stage": 3})
    engine_style = ds_zero.DeepSpeedZeroOptimizer_Stage3(
        torch.optim.SGD(b.parameters(), lr=0.1), config={"stage": 3}, module=b
    )
    assert engine_style.module is b
    with pytest.raises(TypeError, match="needs a module"):
        ds_zero.DeepSpeedZeroOptimizer_Stage3(torch.optim.SGD(Net().parameters(), lr=0.1))
    with pytest.raises(TypeError, match="unexpected positional argument of type int"):
        ds_zero.DeepSpeedZeroOptimizer_Stage3(Net(), 3)


def test_refresh_fp32_params_after_loading_module_weights() -> None:
    torch.manual_seed(0)
    model, source = Net().half(), Net().half()
    opt = ds_zero.DeepSpeedZeroOptimizer_Stage3(model, torch.optim.SGD(model.parameters(), lr=0.0), config={"stage": 3})
    model.load_state_dict(source.state_dict())  # the shards change; the fp32 masters do not yet
    opt.refresh_fp32_params()
    opt.backward(model(torch.randint(0, 40, (2, 3))).float().mean())
    opt.step()  # lr 0: the masters are written back into the shards
    with GatheredParameters(model.parameters()):
        for p, r in zip(model.parameters(), source.parameters(), strict=True):
            torch.testing.assert_close(p, r, atol=0, rtol=0)


class Reader(nn.Module):
    """Reads another module's weight in its forward (registered up front, or discovered on first read)."""

    def __init__(self, source: nn.Linear) -> None:
        super().__init__()
        self.__dict__["source"] = source  # not a submodule
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.source.weight.t() * self.scale


class ReaderNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.reader = Reader(self.a)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reader(torch.tanh(self.a(x)))


@pytest.mark.parametrize("register", [False, True])
def test_external_parameters_join_the_reading_module(register: bool) -> None:
    torch.manual_seed(0)
    ref = ReaderNet()
    model = copy.deepcopy(ref)
    model.reader.__dict__["source"] = model.a
    if register:
        ds_zero.register_external_parameter(model.reader, model.a.weight)
    offload = ds_zero.DeepSpeedZeRoOffload(model, config={"stage3_param_persistence_threshold": 0})
    x = torch.randn(3, 8)
    for _ in range(2):
        torch.testing.assert_close(model(x), ref(x), atol=0, rtol=0)
    unit = offload.coordinator.unit_for(model.reader)
    assert any(p is model.a.weight for p in unit.params)
    assert model.a.weight.ds_status is ZeroParamStatus.NOT_AVAILABLE
    ds_zero.unregister_external_parameter(model.reader, model.a.weight)
    assert all(p is not model.a.weight for p in unit.params)


def test_persistence_thresholds() -> None:
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 2))  # 100 + 10 + 20 + 2 elements
    ds_zero.DeepSpeedZeRoOffload(
        model, config={"stage3_param_persistence_threshold": 50, "stage3_model_persistence_threshold": 15}
    )
    persist = {name: p.ds_persist for name, p in model.named_parameters()}
    # below 50 elements: the biases and the 20-element weight; the 15-element budget admits only 10 + 2
    assert persist == {"0.weight": False, "0.bias": True, "1.weight": False, "1.bias": True}
    assert all(p.ds_status is ZeroParamStatus.AVAILABLE for p in model.parameters() if p.ds_persist)
