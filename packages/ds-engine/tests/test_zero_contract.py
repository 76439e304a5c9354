"""ds-zero's optimizers satisfy the engine's typed ZeRO contract (`ds_engine._step.zero_contract`), structurally.

ds-zero does not import ds-engine, so nothing but this test ties the two: each Protocol member exists
on both classes, with the keywords the engine passes, and a real one-process instance of each is a
`ZeroOptimizer` that takes the engine's `step(skip=...)`.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from ds_engine._step.zero_contract import ZeroOptimizer, ZeroOptimizerFactory, ZeroParamAccess

ds_zero = pytest.importorskip("ds_zero", reason="the contract needs ds-zero: pip install 'ds-engine[zero]'")

CLASSES = ["DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3"]


def _members(protocol: type) -> list[str]:
    return [name for name in protocol.__dict__ if not name.startswith("_")]


@pytest.mark.parametrize("protocol", [ZeroOptimizer, ZeroParamAccess], ids=lambda p: p.__name__)
@pytest.mark.parametrize("name", CLASSES)
def test_every_contract_member_has_a_compatible_signature(name: str, protocol: type) -> None:
    cls = getattr(ds_zero, name)
    for member in _members(protocol):
        ours = getattr(protocol, member)
        theirs = getattr(cls, member, None)
        assert theirs is not None, f"ds_zero.{name} lacks {member}"
        if isinstance(ours, property):
            assert isinstance(theirs, property), f"ds_zero.{name}.{member} must be a property"
            continue
        want = inspect.signature(ours).parameters
        have = inspect.signature(theirs).parameters
        for param in want.values():
            assert param.name in have, f"ds_zero.{name}.{member} takes no {param.name!r}"
            assert (param.default is inspect.Parameter.empty) == (
                have[param.name].default is inspect.Parameter.empty
            ), f"ds_zero.{name}.{member}({param.name})"
    init = inspect.signature(cls.__init__).parameters
    for param in inspect.signature(ZeroOptimizerFactory.__call__).parameters.values():
        if param.kind is inspect.Parameter.KEYWORD_ONLY:
            assert param.name in init, f"ds_zero.{name}() takes no {param.name!r} keyword"


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))


@pytest.mark.parametrize("stage", [1, 3])
def test_instances_are_zero_optimizers_and_honour_skip(stage: int) -> None:
    model = _net()
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    cls = ds_zero.DeepSpeedZeroOptimizer_Stage3 if stage == 3 else ds_zero.DeepSpeedZeroOptimizer
    opt = cls(base, module=model, config=ds_zero.ZeroConfig(stage=stage), clip_grad=0.0, check_overflow=True)
    assert isinstance(opt, ZeroOptimizer) and isinstance(opt, ZeroParamAccess)
    assert all(ds_zero.zero_optimizer_of(p) is opt for p in model.parameters())
    x = torch.randn(3, 4)
    masters = [t.master for t in opt.tiles] if stage == 3 else opt.masters
    before = [m.clone() for m in masters]
    opt.backward(model(x).pow(2).sum())
    assert opt.step(skip=torch.ones(1)) is False  # told to skip: nothing moves
    assert all(torch.equal(a, b) for a, b in zip(before, masters, strict=True))
    opt.zero_grad()
    opt.backward(model(x).pow(2).sum())
    assert opt.step(skip=torch.zeros(1)) is True
    assert isinstance(opt.global_grad_norm, float) and opt.loss_scale == 1.0
    assert not all(torch.equal(a, b) for a, b in zip(before, masters, strict=True))
