"""DeepSpeed's ZeRO-3 user API on 2 ranks: `TiledLinear` training and `unwrap_model_for_generation`.

`TiledLinear` under stage 3 trains as the plain `nn.Linear` it was copied from (the reference: plain
torch on both ranks' batches, gradients averaged), to 1e-6, and `copy_params_from` keeps rank 0's
values on every rank. `unwrap_model_for_generation` gives the same outputs as the hooked model, with no
parameter gathers inside the block, and leaves the model managed as before.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import ds_zero
from ds_comm.testing import run_ranks

CFG = {"stage": 3, "param_persistence_threshold": 0, "reduce_bucket_size": 100, "prefetch_bucket_size": 0}


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(6, 16, generator=g), torch.randint(0, 4, (6,), generator=g)


def _tiled(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 4))
    model = nn.Sequential(ds_zero.TiledLinear(16, 24, in_splits=2, out_splits=3, init_linear=ref[0]), nn.Tanh())
    model.append(copy.deepcopy(ref[2]))
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt = ds_zero.DeepSpeedZeroOptimizer_Stage3(model, torch.optim.Adam(model.parameters(), lr=1e-2), config=CFG)
    losses, ref_losses = [], []
    for step in range(4):
        x, y = _batch(rank, step)
        loss = F.cross_entropy(model(x), y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        ref_opt.zero_grad()
        for r in range(world):
            rl = F.cross_entropy(ref(_batch(r, step)[0]), _batch(r, step)[1])
            (rl / world).backward()
            if r == rank:
                ref_losses.append(rl.item())
        ref_opt.step()
    tiled = model[0]
    with ds_zero.GatheredParameters(list(tiled.parameters())):
        weight = torch.cat([torch.cat([t.weight for t in row], dim=1) for row in tiled.linears]).clone()
    # copy_params_from under stage 3: rank 0's source wins on every rank
    torch.manual_seed(100 + rank)
    tiled.copy_params_from(nn.Linear(16, 24))
    with ds_zero.GatheredParameters(list(tiled.parameters())):
        copied = torch.cat([torch.cat([t.weight for t in row], dim=1) for row in tiled.linears]).clone()
    torch.manual_seed(100)
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "weight": weight,
        "ref_weight": ref[0].weight.detach().clone(),
        "copied": copied,
        "rank0_source": nn.Linear(16, 24).weight.detach().clone(),
    }


def test_tiled_linear_trains_as_the_plain_linear() -> None:
    results = run_ranks(2, _tiled, timeout_s=120)
    for r in results:
        torch.testing.assert_close(r["losses"], r["ref_losses"], rtol=0, atol=1e-6)
        torch.testing.assert_close(r["weight"], r["ref_weight"], rtol=0, atol=1e-6)
        torch.testing.assert_close(r["copied"], results[0]["rank0_source"], rtol=0, atol=0)


def _generation(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = ds_zero.DeepSpeedZeroOptimizer_Stage3(model, torch.optim.SGD(model.parameters(), lr=0.1), config=CFG)
    x, y = _batch(rank, 0)
    opt.backward(F.cross_entropy(model(x), y))
    opt.step()
    opt.zero_grad()
    live = opt.parameter_offload.coordinator.live
    with torch.no_grad():
        hooked = model(x)
    before = live.num_gathers
    params_before = opt.parameter_offload.num_param_gathers
    offload = opt.parameter_offload
    hooks_before = len(offload.forward_hooks)
    with torch.no_grad(), ds_zero.unwrap_model_for_generation(model) as unwrapped:
        hooks_inside = len(offload.forward_hooks)
        inside_gathers = live.num_gathers
        params_on_entry = opt.parameter_offload.num_param_gathers - params_before
        statuses = {p.ds_status for p in unwrapped.parameters()}
        outs = [unwrapped(x) for _ in range(3)]
        gathers_during = live.num_gathers - inside_gathers
    after_statuses = {p.ds_status for p in model.parameters()}
    with torch.no_grad():
        again = model(x)
    return {
        "same": all(torch.equal(o, hooked) for o in outs) and torch.equal(again, hooked),
        "gathered_on_entry": inside_gathers > before,
        "params_on_entry": params_on_entry,
        "num_params": len(list(model.parameters())),
        "gathers_during": gathers_during,
        "statuses": statuses,
        "after": after_statuses,
        "gathers_after": live.num_gathers > inside_gathers,
        # DeepSpeed's `forward_hooks`: one pre and one post hook per module, none inside the block
        "hooks": (hooks_before == 2 * len(list(model.modules())), hooks_inside, len(offload.forward_hooks)),
        "backward_hooks": offload.backward_hooks,
    }


def test_unwrap_model_for_generation_gathers_once_and_restores_the_hooks() -> None:
    for r in run_ranks(2, _generation, timeout_s=120):
        assert r["same"]
        assert r["gathered_on_entry"] and r["gathers_during"] == 0 and r["gathers_after"]
        assert r["params_on_entry"] == r["num_params"]  # each parameter once (nothing persists here)
        assert r["hooks"][:2] == (True, 0) and r["hooks"][2] > 0 and r["backward_hooks"] == []
        assert r["statuses"] == {ds_zero.ZeroParamStatus.AVAILABLE}
        assert r["after"] == {ds_zero.ZeroParamStatus.NOT_AVAILABLE}
