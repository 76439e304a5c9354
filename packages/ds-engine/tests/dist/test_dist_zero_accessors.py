"""`deepspeed.utils.safe_get_full_fp32_param` and friends through the engine, on 2 ranks, against plain PyTorch.

Each rank trains on its own batch; the reference is one plain `torch.optim.AdamW` on the same initial
weights whose gradients are the two batches' mean. Between backward and step the whole gradient read
through the accessors equals the reference gradient; after each step the whole fp32 master and the
Adam state equal the reference's (1e-6). Setters are checked by doing the same edit on the reference
(a doubled gradient, a vectorized update, a new weight and a new `exp_avg`) and comparing the next
steps; the ZeRO-3 local accessors by their slice of the whole value. Stages 1, 2, 3, with and without
CPU optimizer offload, and stage 0 (no partitioned state: the fp32 getters give None, as in DeepSpeed).
With bf16 weights the fp32 master read back is the separate fp32 copy that rounds to the weights.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import pytest
import torch
from torch import nn

from ds_comm.testing import run_ranks

pytest.importorskip("ds_zero", reason="the ZeRO accessors need ds-zero: pip install 'ds-engine[zero]'")

ATOL = 1e-6


class Net(nn.Module):
    """212 parameters: at stages 1/2 `l1.weight` straddles the two ranks' partitions."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 16)
        self.l2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.l1(x)))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def _reference_grads(ref: nn.Module, step: int, world: int) -> None:
    ref.zero_grad()
    for r in range(world):
        (_loss(ref, *_batch(r, step)) / world).backward()


def _close(ours: torch.Tensor | None, theirs: torch.Tensor, what: str) -> None:
    assert ours is not None, f"{what}: None"
    assert ours.dtype == torch.float32, f"{what}: {ours.dtype}"
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-5, atol=ATOL, msg=lambda m: f"{what}: {m}")


def _run(rank: int, world: int, stage: int, offload: bool) -> dict[str, Any]:
    import ds_engine as deepspeed
    from ds_engine.utils import (
        safe_get_full_fp32_param,
        safe_get_full_grad,
        safe_get_full_optimizer_state,
        safe_get_local_fp32_param,
        safe_get_local_grad,
        safe_get_local_optimizer_state,
        safe_set_full_fp32_param,
        safe_set_full_grad,
        safe_set_full_optimizer_state,
        safe_set_local_fp32_param,
        safe_set_local_grad,
        safe_update_full_grad_vectorized,
    )

    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    zero: dict[str, Any] = {"stage": stage, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 50}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 0.0,  # DeepSpeed's default is 1.0; the reference does not clip
        "zero_optimization": zero,
        "zero_force_ds_cpu_optimizer": False,
        "zero_allow_untested_optimizer": True,
    }
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), config=config
    )
    named = dict(engine.module.named_parameters())
    refs = dict(ref.named_parameters())
    params = list(named.values())
    checks = 0

    if stage == 0:  # no partitioned fp32 state: DeepSpeed's answers
        engine.backward(_loss(engine, *_batch(rank, 0)))
        assert all(safe_get_full_fp32_param(p) is None for p in params)
        assert all(safe_get_full_optimizer_state(p, "exp_avg") is None for p in params)
        assert all(safe_get_full_grad(p) is p.grad and p.grad is not None for p in params)
        with pytest.raises(ValueError, match="ZeRO-3 partitioned parameters only"):
            safe_get_local_fp32_param(params[0])
        return {"checks": 4}

    for step in range(4):
        x, y = _batch(rank, step)
        engine.backward(_loss(engine, x, y))
        _reference_grads(ref, step, world)
        for name, p in named.items():
            _close(safe_get_full_grad(p), refs[name].grad, f"step {step} grad {name}")
            checks += 1
        if step == 1:  # a whole new gradient for one parameter, on every rank
            new = refs["l2.weight"].grad * 2 + 0.01
            safe_set_full_grad(named["l2.weight"], new)
            refs["l2.weight"].grad.copy_(new)
            _close(safe_get_full_grad(named["l2.weight"]), new, "set grad")
        if step == 2:
            safe_update_full_grad_vectorized(params, lambda g, p: g.clamp(-0.05, 0.05) * 0.5)
            for r in refs.values():
                r.grad.copy_(r.grad.clamp(-0.05, 0.05) * 0.5)
        if stage == 3:
            p = named["l1.weight"]
            whole = safe_get_full_grad(p)
            s = p.ds_tensor.numel()
            local = safe_get_local_grad(p)
            expect = torch.zeros(s)
            piece = whole.reshape(-1)[rank * s : (rank + 1) * s]
            expect[: piece.numel()] = piece
            _close(local, expect, "local grad")
            if step == 3:  # scale this rank's slice; every rank does, so the whole gradient is scaled
                safe_set_local_grad(p, local * 3)
                refs["l1.weight"].grad.mul_(3)
        engine.step()
        ref_opt.step()
        for name, p in named.items():
            _close(safe_get_full_fp32_param(p), refs[name].detach(), f"step {step} fp32 {name}")
            for key in ("exp_avg", "exp_avg_sq"):
                _close(safe_get_full_optimizer_state(p, key), ref_opt.state[refs[name]][key], f"{key} {name}")
            checks += 3
        if stage < 3:
            with pytest.raises(ValueError, match="only available between backward"):
                safe_get_full_grad(params[0])

    # setters of the fp32 master and the optimizer state, then one more step on both sides
    new_bias = torch.linspace(-1, 1, 16)
    safe_set_full_fp32_param(named["l1.bias"], new_bias)
    _close(safe_get_full_fp32_param(named["l1.bias"]), new_bias, "set fp32 param")
    new_avg = torch.full((4, 16), 0.001)
    safe_set_full_optimizer_state(named["l2.weight"], new_avg, "exp_avg")
    _close(safe_get_full_optimizer_state(named["l2.weight"], "exp_avg"), new_avg, "set exp_avg")
    with torch.no_grad():
        refs["l1.bias"].copy_(new_bias)
        ref_opt.state[refs["l2.weight"]]["exp_avg"].copy_(new_avg)
    if stage == 3:
        p = named["l2.bias"]
        s = p.ds_tensor.numel()
        whole = safe_get_full_fp32_param(p)
        local = safe_get_local_fp32_param(p)
        expect = torch.zeros(s)
        expect[: min(s, 4 - rank * s)] = whole[rank * s : (rank + 1) * s]
        _close(local, expect, "local fp32")
        safe_set_local_fp32_param(p, local + 0.5)
        with torch.no_grad():
            refs["l2.bias"][rank * s : (rank + 1) * s].add_(0.5)
            other = 1 - rank  # the other rank moved its slice too
            refs["l2.bias"][other * s : (other + 1) * s].add_(0.5)
        state = safe_get_local_optimizer_state(p, "exp_avg_sq")
        assert state is not None and state.numel() == s
    else:
        with pytest.raises(ValueError, match="ZeRO-3 partitioned parameters only"):
            safe_get_local_fp32_param(params[0])
    x, y = _batch(rank, 9)
    engine.backward(_loss(engine, x, y))
    _reference_grads(ref, 9, world)
    engine.step()
    ref_opt.step()
    for name, p in named.items():
        _close(safe_get_full_fp32_param(p), refs[name].detach(), f"after the setters: fp32 {name}")
    # the model's own weights took the masters at the step
    weights = {n: p.detach().clone() for n, p in named.items()} if stage < 3 else None
    if weights is not None:
        for name, w in weights.items():
            _close(w, refs[name].detach(), f"model weight {name}")
    return {"checks": checks}


@pytest.mark.parametrize(
    ("stage", "offload"),
    [(0, False), (1, False), (2, False), (3, False), (2, True), (3, True)],
    ids=["stage0", "stage1", "stage2", "stage3", "stage2-offload", "stage3-offload"],
)
def test_accessors_match_plain_torch(stage: int, offload: bool) -> None:
    results = run_ranks(2, _run, stage, offload, timeout_s=180)
    assert all(r["checks"] > 0 for r in results)


def _bf16(rank: int, world: int) -> dict[str, Any]:
    """bf16 weights: the accessors give the separate fp32 master, which rounds to the model's weights."""
    import ds_engine as deepspeed
    from ds_engine.utils import safe_get_full_fp32_param, safe_get_full_grad

    out = {}
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        model = Net()
        initial = {n: p.detach().clone() for n, p in model.named_parameters()}
        config = {
            "train_micro_batch_size_per_gpu": 4,
            "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        }
        engine, *_ = deepspeed.initialize(model=model, config=config)
        named = dict(engine.module.named_parameters())
        start = {n: safe_get_full_fp32_param(p) for n, p in named.items()}
        x, y = _batch(rank, 0)
        engine.backward(_loss(engine, x.bfloat16(), y.bfloat16()))
        grads = {n: safe_get_full_grad(p) for n, p in named.items()}
        engine.step()
        after = {n: safe_get_full_fp32_param(p) for n, p in named.items()}
        gather = deepspeed.zero.GatheredParameters(list(named.values())) if stage == 3 else contextlib.nullcontext()
        with gather:
            weights = {n: p.detach().clone() for n, p in named.items()}
        out[stage] = {
            "start_is_bf16_of_initial": all(torch.equal(start[n], initial[n].bfloat16().float()) for n in named),
            "grads_fp32": all(g is not None and g.dtype == torch.float32 for g in grads.values()),
            "rounds_to_weights": all(torch.equal(after[n].bfloat16(), weights[n]) for n in named),
            "finer_than_bf16": any(not torch.equal(after[n], weights[n].float()) for n in named),
        }
    return out


def test_bf16_master_is_the_fp32_copy() -> None:
    for result in run_ranks(2, _bf16, timeout_s=180):
        for stage, checks in result.items():
            assert all(checks.values()), (stage, checks)
