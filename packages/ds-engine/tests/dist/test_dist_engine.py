"""2 gloo ranks: the stage-0 engine against torch DDP, the init broadcast, and the all-reduce scaling options."""

from __future__ import annotations

import torch
from ds_engine_testkit import base_config, batches, flat_params, loss_fn, make_engine, tiny_net
from torch.nn.parallel import DistributedDataParallel as DDP

from ds_comm.testing import run_ranks

STEPS, GAS = 6, 2


def _ddp(rank: int) -> tuple[list[float], torch.Tensor]:
    model = DDP(tiny_net(seed=rank))  # DDP broadcasts rank 0's weights at construction
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = batches(STEPS * GAS, 4, seed=100 + rank)
    losses = []
    for step in range(STEPS):
        for micro in range(GAS):
            x, y = data[step * GAS + micro]
            if micro < GAS - 1:
                with model.no_sync():
                    loss = loss_fn(model(x), y)
                    (loss / GAS).backward()
            else:
                loss = loss_fn(model(x), y)
                (loss / GAS).backward()
            losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    return losses, flat_params(model.module)


def _engine(rank: int, **cfg: object) -> tuple[list[float], torch.Tensor]:
    model = tiny_net(seed=rank)  # different on each rank: initialize() must broadcast rank 0's
    engine = make_engine(model, base_config(**{"gradient_accumulation_steps": GAS, "gradient_clipping": 0.5, **cfg}))
    assert engine.world_size == 2 and engine.dp_world_size == 2 and engine.train_batch_size() == 16
    data = batches(STEPS * GAS, 4, seed=100 + rank)
    losses = []
    for x, y in data:
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, flat_params(model)


def _against_ddp(rank: int, world: int) -> dict[str, object]:
    return {"ddp": _ddp(rank), "engine": _engine(rank)}


def test_two_ranks_match_torch_ddp() -> None:
    results = run_ranks(2, _against_ddp, timeout_s=120)
    for r in results:
        ddp_losses, ddp_params = r["ddp"]
        losses, params = r["engine"]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ddp_losses), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(params, ddp_params, rtol=1e-6, atol=1e-6)
    assert torch.equal(results[0]["engine"][1], results[1]["engine"][1])  # replicas stay identical


def _variants(rank: int, world: int) -> dict[str, torch.Tensor]:
    sgd = {"type": "SGD", "params": {"lr": 0.1}}
    out = {
        "mean": _engine(rank, optimizer=sgd)[1],
        "prescale": _engine(rank, optimizer=sgd, prescale_gradients=True)[1],
        "predivide": _engine(rank, optimizer=sgd, gradient_predivide_factor=2.0)[1],
        "small_buckets": _engine(rank, optimizer=sgd, zero_optimization={"stage": 0, "reduce_bucket_size": 50})[1],
        # A sum of two ranks' gradients with half the lr is the mean with the full lr (clipping off).
        "mean_noclip": _engine(rank, optimizer=sgd, gradient_clipping=0.0)[1],
        "sum_half_lr": _engine(
            rank, optimizer={"type": "SGD", "params": {"lr": 0.05}}, gradient_clipping=0.0, gradient_allreduce_op="sum"
        )[1],
        "comm_bf16": _engine(rank, optimizer=sgd, communication_data_type="bf16")[1],
    }
    bf16_model = tiny_net(seed=rank)
    engine = make_engine(bf16_model, base_config(bf16={"enabled": True}, gradient_accumulation_steps=GAS))
    for x, y in batches(4, 4, seed=7 + rank):
        engine.backward(loss_fn(engine(x.bfloat16()), y))
        engine.step()
    out["bf16"] = flat_params(bf16_model)
    out["bf16_masters"] = torch.cat([m.detach().reshape(-1) for m in engine.optimizer.masters])
    return out


def test_allreduce_scaling_options_and_bf16_stay_consistent() -> None:
    r0, r1 = run_ranks(2, _variants, timeout_s=120)
    for key in r0:
        assert torch.equal(r0[key], r1[key]), key  # every option keeps the replicas identical
    for key in ("prescale", "predivide", "small_buckets"):
        torch.testing.assert_close(r0[key], r0["mean"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(r0["sum_half_lr"], r0["mean_noclip"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(r0["comm_bf16"], r0["mean"], rtol=0, atol=2e-3)
    assert not torch.equal(r0["comm_bf16"], r0["mean"])  # the bf16 all-reduce really ran in bf16
    torch.testing.assert_close(r0["bf16_masters"].bfloat16().float(), r0["bf16"])
