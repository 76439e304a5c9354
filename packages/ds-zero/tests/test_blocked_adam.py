"""`step_in_blocks` equals torch's own Adam/AdamW step bit for bit, and leaves alone what it cannot reproduce.

The block size is patched down to 256 elements so that small tensors span many blocks, a partial last
block included; the sizes cover a tensor smaller than a block, one of exactly two blocks and odd ones.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from ds_zero import _blocked_adam
from ds_zero._blocked_adam import step_in_blocks

SIZES = (7, 512, 1000, 4099)


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=g)) for n in SIZES] + [
        torch.nn.Parameter(torch.randn(33, 17, generator=g))
    ]


def _set_grads(params: list[torch.nn.Parameter], step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * (10.0 ** (step % 3 - 1))


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_blocked_adam, "BLOCK", 256)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("foreach", [True, False, None])
@pytest.mark.parametrize(
    ("kind", "options"),
    [
        (torch.optim.AdamW, {"weight_decay": 0.01}),
        (torch.optim.AdamW, {"weight_decay": 0.0, "betas": (0.8, 0.95), "eps": 1e-6}),
        (torch.optim.Adam, {"weight_decay": 0.1}),
        (torch.optim.Adam, {}),
    ],
)
def test_equals_torch_step_bit_for_bit(kind: type, options: dict, foreach: bool | None, threads: int) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ours, theirs = _params(0), _params(0)
        opt_ours = kind([{"params": ours[:3]}, {"params": ours[3:], "lr": 3e-3}], lr=1e-3, foreach=foreach, **options)
        opt_theirs = kind(
            [{"params": theirs[:3]}, {"params": theirs[3:], "lr": 3e-3}], lr=1e-3, foreach=foreach, **options
        )
        used = []
        for step in range(6):
            _set_grads(ours, step)
            _set_grads(theirs, step)
            if step == 3:  # a scheduler's change of the learning rate between steps
                for opt in (opt_ours, opt_theirs):
                    opt.param_groups[0]["lr"] = 5e-4
            used.append(step_in_blocks(opt_ours))
            if not used[-1]:
                opt_ours.step()
            opt_theirs.step()
        assert used == [False] + [True] * 5  # the first step creates torch's state through step()
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a, b)
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(opt_ours.state[a][key], opt_theirs.state[b][key]), key
    finally:
        torch.set_num_threads(before)


def _stepped(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    _set_grads(params, 0)
    opt.step()
    _set_grads(params, 1)
    return opt


class _MyAdam(torch.optim.Adam):
    pass


@pytest.mark.parametrize(
    "build",
    [
        lambda ps: torch.optim.Adam(ps, amsgrad=True),
        lambda ps: torch.optim.AdamW(ps, maximize=True),
        lambda ps: torch.optim.Adam(ps, lr=torch.tensor(1e-3)),
        lambda ps: _MyAdam(ps),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    ],
    ids=["amsgrad", "maximize", "tensor-lr", "subclass", "sgd"],
)
def test_leaves_other_optimizers_to_their_own_step(build) -> None:
    params = _params(1)
    opt = _stepped(build(params), params)
    before = [p.detach().clone() for p in params]
    assert step_in_blocks(opt) is False
    assert all(torch.equal(a, b) for a, b in zip(params, before, strict=True))


def test_leaves_an_optimizer_with_step_hooks_to_its_own_step() -> None:
    params = _params(2)
    opt = _stepped(torch.optim.AdamW(params), params)
    calls = []
    opt.register_step_post_hook(lambda *args: calls.append(1))
    assert step_in_blocks(opt) is False
    opt.step()
    assert calls == [1]


def test_a_step_counter_that_is_not_a_tensor_is_left_to_torch() -> None:
    params = _params(5)
    opt = _stepped(torch.optim.AdamW(params), params)
    for p in params:
        opt.state[p]["step"] = float(opt.state[p]["step"])
    assert step_in_blocks(opt) is False


def test_first_step_is_left_to_torch() -> None:
    params = _params(3)
    opt = torch.optim.AdamW(params)
    _set_grads(params, 0)
    assert step_in_blocks(opt) is False
    assert opt.state == {}


def test_a_scheduler_sees_the_blocked_step_as_a_step() -> None:
    params = _params(4)
    opt = torch.optim.AdamW(params)
    _set_grads(params, 0)
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _set_grads(params, 1)
    assert step_in_blocks(opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Detected call of `lr_scheduler.step()` before `optimizer.step()`"
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(5e-4)
