"""fp16 master weights and gradients (`fp16_master_weights_and_gradients`, DeepSpeed's
`fp16.fp16_master_weights_and_grads`) at ZeRO stages 1, 2 and 3 with the optimizer offloaded to the CPU, on 2 gloo
ranks.

Reference: plain PyTorch doing the same math on one process: the fp16 model, each rank's fp16 gradients
averaged over the ranks (summed in fp32, halved, rounded to fp16), and AdamW written out in fp32 over fp32
moments with the result rounded to the fp16 parameter, which is what DeepSpeedCPUAdam does with fp16 parameters.
Tolerance: after 5 steps at least 99.5% of each parameter's elements within 2 fp16 ulps (relative 2**-9) of the
reference plus an absolute 1e-4 floor, the rest (an element whose gradient halves nearly cancel and round to the
other sign in an fp16 sum) within 2 * lr * steps; the losses within 2 fp16 ulps (the fp16 model computes them).
Stages 2 and 3 match to the 2 ulps everywhere in practice; stage 1, which reduces at the boundary, moves a
handful of such elements. Also: the masters and gradient partitions really are fp16 and the moments
fp32 (2 + 2 + 4 + 4 = 12 bytes of model state per trained element), and what DeepSpeed refuses is refused.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from stage3_cases import (
    batch,
    gathered_state,
    loss_fn,
    make_model,
    partition_tensors,
    state_bytes_per_element,
    train_steps,
)

import ds_zero
from ds_comm.testing import run_ranks

FP16 = {"fp16_master_weights_and_gradients": True}
STEPS = 5
LR, WD, BETAS, EPS = 1e-2, 0.01, (0.9, 0.999), 1e-8
CPU_OFFLOAD = {"offload_optimizer": {"device": "cpu"}}
STAGE3 = {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 4000}


def _build(stage: int, **kwargs: Any) -> tuple[torch.nn.Module, Any]:
    import ds_ops

    model = make_model().to(torch.float16)
    base = ds_ops.DeepSpeedCPUAdam(
        [p for p in model.parameters() if p.requires_grad], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD
    )
    if stage == 3:
        return model, ds_zero.DeepSpeedZeroOptimizer_Stage3(model, base, config={**STAGE3, **CPU_OFFLOAD}, **kwargs)
    cfg = ds_zero.ZeroConfig(stage=stage, reduce_bucket_size=500, allgather_bucket_size=1000, **CPU_OFFLOAD)
    return model, ds_zero.DeepSpeedZeroOptimizer(base, config=cfg, module=model, **kwargs)


def _adamw(p16: torch.Tensor, g16: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int) -> None:
    """One AdamW step in fp32 over fp32 moments, the result rounded into the fp16 parameter."""
    p, g = p16.float(), g16.float()
    p.mul_(1 - LR * WD)
    m.mul_(BETAS[0]).add_(g, alpha=1 - BETAS[0])
    v.mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
    denom = (v.sqrt() / math.sqrt(1 - BETAS[1] ** step)).add_(EPS)
    p.addcdiv_(m, denom, value=-LR / (1 - BETAS[0] ** step))
    p16.copy_(p)


def _reference(world: int) -> tuple[dict[str, torch.Tensor], list[list[float]]]:
    model = make_model().to(torch.float16)
    params = [p for p in model.parameters() if p.requires_grad]
    moments = [(torch.zeros_like(p, dtype=torch.float32), torch.zeros_like(p, dtype=torch.float32)) for p in params]
    losses = []
    for step in range(STEPS):
        sums = [torch.zeros_like(p, dtype=torch.float32) for p in params]
        per_rank = []
        for r in range(world):
            model.zero_grad(set_to_none=True)
            idx, tgt = batch(r, step, 0)
            loss = loss_fn(model(idx), tgt)
            loss.backward()
            per_rank.append(loss.item())
            for s, p in zip(sums, params, strict=True):
                s.add_(p.grad.float())
        with torch.no_grad():
            for s, p, (m, v) in zip(sums, params, moments, strict=True):
                _adamw(p.data, (s / world).to(torch.float16), m, v, step + 1)
        losses.append(per_rank)
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}, losses


def _run(rank: int, world: int, stage: int) -> dict[str, Any]:
    model, opt = _build(stage, **FP16)
    losses = train_steps(model, opt, rank, range(STEPS), gas=1)
    idx, tgt = batch(rank, 100, 0)
    opt.backward(loss_fn(model(idx), tgt))  # gradients held: their dtype mid-step
    masters, grads, states = partition_tensors(opt, stage)
    opt.zero_grad()
    params = (
        gathered_state(model) if stage == 3 else {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    )
    out = {
        "params": params,
        "losses": losses,
        "dtypes": {
            "masters": {str(t.dtype) for t in masters},
            "grads": {str(t.dtype) for t in grads},
            "moments": {str(t.dtype) for t in states},
        },
        "bytes": state_bytes_per_element(opt, model, rank, stage),
    }
    out["ref_params"], out["ref_losses"] = _reference(world)
    return out


def _all_stages(rank: int, world: int) -> dict[int, dict[str, Any]]:
    return {stage: _run(rank, world, stage) for stage in (1, 2, 3)}


@pytest.fixture(scope="module")
def results() -> dict[int, dict[str, Any]]:
    return run_ranks(2, _all_stages, timeout_s=240)[0]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp16_masters_match_plain_pytorch(stage: int, results: dict[int, dict[str, Any]]) -> None:
    r = results[stage]
    for step, (ours, ref) in enumerate(zip(r["losses"], r["ref_losses"], strict=True)):
        assert abs(ours - ref[0]) <= 2**-9 * abs(ref[0]), (step, ours, ref[0])  # 2 fp16 ulps of the loss
    for name, ref in r["ref_params"].items():
        diff = (r["params"][name] - ref).abs()
        off = diff > 1e-4 + 2**-9 * ref.abs()
        # a gradient element whose two ranks' halves nearly cancel can round to the other sign in an fp16 sum
        # (stage 1 reduces at the boundary in another order than the reference): Adam then moves it ~2 lr the
        # other way; a handful of such elements, never more than a few steps' worth
        assert off.float().mean() <= 0.005, (name, int(off.sum()), ref.numel())
        assert float(diff.max()) <= 2 * LR * STEPS, (name, float(diff.max()))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_masters_and_gradients_are_fp16_and_moments_fp32(stage: int, results: dict[int, dict[str, Any]]) -> None:
    r = results[stage]
    assert r["dtypes"] == {"masters": {"torch.float16"}, "grads": {"torch.float16"}, "moments": {"torch.float32"}}
    assert r["bytes"] == 12.0  # 2 master + 2 gradient + 4 + 4 Adam moments


def _refusal(rank: int, world: int, stage: int, kwargs: dict[str, bool], offload: bool, torch_adam: bool) -> str:
    import ds_ops

    model = make_model().to(torch.float16)
    params = [p for p in model.parameters() if p.requires_grad]
    base = torch.optim.AdamW(params, lr=LR) if torch_adam else ds_ops.DeepSpeedCPUAdam(params, lr=LR)
    extra = CPU_OFFLOAD if offload else {}
    try:
        if stage == 3:
            ds_zero.DeepSpeedZeroOptimizer_Stage3(model, base, config={**STAGE3, **extra}, **kwargs)
        else:
            ds_zero.DeepSpeedZeroOptimizer(
                base, config=ds_zero.ZeroConfig(stage=stage, **extra), module=model, **kwargs
            )
    except ValueError as err:
        return str(err)
    return "accepted"


@pytest.mark.parametrize(
    ("kwargs", "offload", "torch_adam", "needle"),
    [
        ({**FP16, "bf16_master_weights_and_gradients": True}, True, False, "exclude each other"),
        (FP16, False, False, "needs zero_optimization.offload_optimizer.device 'cpu' or 'nvme'"),
        (FP16, True, True, "needs DeepSpeedCPUAdam as the base optimizer"),
    ],
    ids=["with-bf16-masters", "no-offload", "torch-adamw"],
)
@pytest.mark.parametrize("stage", [2, 3])
def test_refused_combinations_name_the_key(
    stage: int, kwargs: dict[str, bool], offload: bool, torch_adam: bool, needle: str
) -> None:
    message = run_ranks(1, _refusal, stage, kwargs, offload, torch_adam, timeout_s=60)[0]
    assert needle in message and "fp16.fp16_master_weights_and_grads" in message, message
