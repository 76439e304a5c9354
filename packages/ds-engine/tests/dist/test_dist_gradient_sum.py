"""`gradient_allreduce_op: "sum"` at ZeRO stages 0, 1 and 2 on 2 gloo ranks: the step uses the plain sum of the
ranks' gradients, whatever `prescale_gradients` and `gradient_predivide_factor` say (DeepSpeed scales by
neither for a sum; stage 3 refuses "sum").

The reference is plain PyTorch: each rank's autograd gradients all-reduced with SUM (DDP without its division
by the world size), then the same SGD step. SGD, because Adam's update barely moves when every gradient doubles.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ds_engine_testkit import base_config, batches, flat_params, loss_fn, make_engine, tiny_net

from ds_comm.testing import run_ranks

pytest.importorskip("ds_zero", reason="stages 1 and 2 need ds-zero")

STEPS, GAS, LR = 3, 2, 0.05
SCALINGS = {
    "plain": {},
    "prescale": {"prescale_gradients": True},
    "predivide": {"gradient_predivide_factor": 2.0},
}


def _reference(rank: int, world: int, average: bool) -> torch.Tensor:
    model = tiny_net(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data = batches(STEPS * GAS, 4, seed=50 + rank)
    for step in range(STEPS):
        for x, y in data[step * GAS : (step + 1) * GAS]:
            (loss_fn(model(x), y) / GAS).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            if average:
                p.grad /= world
        opt.step()
        opt.zero_grad()
    return flat_params(model)


def _engine(rank: int, stage: int, op: str, scaling: dict[str, object]) -> torch.Tensor:
    model = tiny_net(seed=0)
    zero = {"stage": stage}
    if stage == 2 and "gradient_predivide_factor" in scaling:
        zero["reduce_scatter"] = False
    config = base_config(
        gradient_accumulation_steps=GAS,
        gradient_allreduce_op=op,
        optimizer={"type": "SGD", "params": {"lr": LR}},
        zero_optimization=zero,
        zero_allow_untested_optimizer=True,
        **scaling,
    )
    engine = make_engine(model, config)
    for x, y in batches(STEPS * GAS, 4, seed=50 + rank):
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    return flat_params(model)


def _rank(rank: int, world: int) -> dict[str, object]:
    out: dict[str, object] = {"sum": _reference(rank, world, False), "mean": _reference(rank, world, True)}
    for stage in (0, 1, 2):
        for name, scaling in SCALINGS.items():
            out[f"s{stage}-sum-{name}"] = _engine(rank, stage, "sum", scaling)
        out[f"s{stage}-mean"] = _engine(rank, stage, "mean", {})
    return out


def test_sum_steps_on_the_summed_gradients_at_stages_0_1_2() -> None:
    r0, r1 = run_ranks(2, _rank, timeout_s=180)
    assert not torch.allclose(r0["sum"], r0["mean"], atol=1e-3)  # the data tells a sum from a mean
    for key in r0:
        torch.testing.assert_close(r1[key], r0[key], rtol=0, atol=0)  # replicas stay identical
        if key in ("sum", "mean"):
            continue
        reference = r0["mean"] if key.endswith("-mean") else r0["sum"]
        torch.testing.assert_close(r0[key], reference, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")
