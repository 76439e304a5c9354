"""Tensors taken from gathered parameters outlive the gather, as in DeepSpeed (2 ranks, ZeRO stage 3).

Inside `GatheredParameters` (and between `param.all_gather()` and `param.partition()`), `param.detach()`
and, on a CPU, `param.cpu()` (no copy there) share the full values' storage. DeepSpeed's release swaps
`.data` for an empty tensor, so such a tensor keeps its values afterwards; DeepSpeed's own
`TestZeroToFP32` collects the reference weights that way. Here the released parameter leaves the storage
to those tensors and gathers into a new one next time; training afterwards (whose backward re-reads
gathered weights through the saved-tensor net) still equals DDP.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from stage3_cases import STAGE3_CFG, batch, loss_fn, make_model, train_steps

import ds_zero
from ds_comm.testing import run_ranks
from ds_zero import GatheredParameters, ZeroParamStatus


def _taken_values(rank: int, world: int) -> dict[str, Any]:
    ref = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(ref)
    base = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    ref_losses = []
    for step in range(4):
        idx, tgt = batch(rank, step, 0)
        loss = loss_fn(ddp(idx), tgt)
        loss.backward()
        base.step()
        base.zero_grad()
        ref_losses.append(loss.item())
        if step == 1:
            after_two = {n: p.detach().clone() for n, p in ref.named_parameters()}
    model = make_model()
    opt = ds_zero.DeepSpeedZeroOptimizer_Stage3(
        model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1), config=STAGE3_CFG
    )
    losses = train_steps(model, opt, rank, range(2), gas=1)
    taken = {}
    for name, p in model.named_parameters():  # one block per parameter, as TestZeroToFP32 does
        with GatheredParameters(p):
            taken[name] = p.detach().cpu()
    fc1 = model.blocks[0].fc1.weight
    fc1.all_gather()
    by_api = fc1.detach()
    fc1.partition()
    released = [n for n, p in model.named_parameters() if p.ds_status is ZeroParamStatus.NOT_AVAILABLE]
    persistent = [n for n, p in model.named_parameters() if p.ds_persist]
    losses += train_steps(model, opt, rank, range(2, 4), gas=1)
    with GatheredParameters(list(model.parameters())):
        final = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {
        "persistent": persistent,
        "final": final,
        "taken": taken,
        "by_api": by_api,
        "after_two": after_two,
        "released": released,
        "losses": losses,
        "ref_losses": ref_losses,
    }


@pytest.mark.timeout(300)
def test_values_taken_inside_a_gather_survive_the_release_and_training_goes_on() -> None:
    for r in run_ranks(2, _taken_values, timeout_s=280):
        assert len(r["released"]) > 3  # the partitioned ones were released all the same
        assert r["taken"].keys() == r["after_two"].keys()
        assert r["persistent"]  # the case below is exercised
        for name, value in r["after_two"].items():
            # A persistent parameter is never released: what was taken aliases it, as `p.detach()` of a plain
            # parameter does, and follows its later steps (DeepSpeed re-gathers it into a new tensor instead).
            expected = r["final"][name] if name in r["persistent"] else value
            torch.testing.assert_close(r["taken"][name], expected, atol=1e-6, rtol=1e-5, msg=name)
        torch.testing.assert_close(r["by_api"], r["after_two"]["blocks.0.fc1.weight"], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(r["losses"], r["ref_losses"], atol=1e-5, rtol=1e-5)
