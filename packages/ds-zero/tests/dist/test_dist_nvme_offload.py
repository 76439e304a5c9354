"""NVMe offload (ZeRO-Infinity) on 2 gloo ranks: equal to no offload, checkpoints, and a CPU-memory budget.

* Parameters and optimizer state on "NVMe" (a directory on this disk), with read-ahead along the trace,
  pipelined sub-group swapping and small buffers, match the same stage-3 run without offload to 1e-6 over
  10 steps (TinyGPT: tied weights, a frozen layer, a module called twice, external parameters).
* Its checkpoint is an ordinary ds-zero checkpoint: a run without offload and a fresh NVMe run load it
  and continue exactly like the original; `zero_to_fp32` consolidates it.
* A model whose optimizer state per rank exceeds a host-memory budget trains with NVMe offload; the bytes
  each rank holds (swap buffers, resident shards and state, gradient partitions, gathered parameters) are
  measured at every module boundary and after every step, and stay under the budget.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from stage3_cases import STAGE3_CFG, gathered_state, make_model, train_steps
from torch import nn

import ds_zero
from ds_comm.testing import run_ranks
from ds_zero._params.partitioned_param import state_of

STEPS = 10


def _nvme(path: str, **optimizer: Any) -> dict[str, Any]:
    return dict(
        STAGE3_CFG,
        sub_group_size=1500,
        offload_param={"device": "nvme", "nvme_path": path, "buffer_count": 5, "buffer_size": 8192, "max_in_cpu": 0},
        offload_optimizer={"device": "nvme", "nvme_path": path, **optimizer},
    )


def _setup(config: dict[str, Any], seed: int = 0) -> tuple[nn.Module, Any]:
    model = make_model(seed)
    base = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)
    return model, ds_zero.DeepSpeedZeroOptimizer_Stage3(
        model, base, config=config, clip_grad=0.5, aio_config={"queue_depth": 4}
    )


def _train(model: nn.Module, opt: Any, rank: int, steps: range) -> list[float]:
    return train_steps(model, opt, rank, steps, gas=2)


def _nvme_vs_plain(rank: int, world: int, *, root: str) -> dict[str, Any]:
    plain, plain_opt = _setup(dict(STAGE3_CFG))
    ref = _train(plain, plain_opt, rank, range(STEPS))
    model, opt = _setup(_nvme(f"{root}/nvme", pipeline_read=True, pipeline_write=True))
    losses = _train(model, opt, rank, range(STEPS))
    swapped = sum(state_of(p).swap is not None for p in model.parameters())
    ckpt = f"{root}/ckpt"
    ds_zero.save_zero_checkpoint(ckpt, "step10", opt, model)
    final = gathered_state(model)
    swapper = opt.parameter_offload.param_swapper
    reads = (swapper.num_reads, opt.optimizer_swapper.num_reads, swapper.num_kept_hits)
    cont = _train(model, opt, rank, range(STEPS, STEPS + 2))
    loaded, loaded_opt = _setup(dict(STAGE3_CFG), seed=7)
    ds_zero.load_zero_checkpoint(ckpt, loaded_opt, loaded)
    loaded_state = gathered_state(loaded)
    loaded_cont = _train(loaded, loaded_opt, rank, range(STEPS, STEPS + 2))
    back, back_opt = _setup(_nvme(f"{root}/back"), seed=8)  # no pipelining this time
    ds_zero.load_zero_checkpoint(ckpt, back_opt, back)
    back_cont = _train(back, back_opt, rank, range(STEPS, STEPS + 2))
    return {
        "ref": ref,
        "losses": losses,
        "ref_state": gathered_state(plain),
        "final": final,
        "swapped": swapped,
        "reads": reads,
        "cont": cont,
        "loaded_state": loaded_state,
        "loaded_cont": loaded_cont,
        "back_cont": back_cont,
    }


@torch.no_grad()
def test_nvme_offload_matches_no_offload_and_its_checkpoint_is_ordinary(tmp_path: Path) -> None:
    (tmp_path / "nvme").mkdir()
    (tmp_path / "back").mkdir()
    out = run_ranks(2, _nvme_vs_plain, root=str(tmp_path), timeout_s=150)
    for r in out:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["ref"]), rtol=0, atol=1e-6)
        for key, value in r["ref_state"].items():
            torch.testing.assert_close(r["final"][key], value, rtol=1e-6, atol=1e-6)
        # the last: gathers that found their shards still in the pool (it holds every shard of this model)
        assert r["swapped"] >= 8 and min(r["reads"]) > 0
        for key, value in r["final"].items():
            torch.testing.assert_close(r["loaded_state"][key], value, rtol=0, atol=0)
        # the in-memory run sums the clipping norm over whole partitions, the NVMe run tile by tile
        assert r["loaded_cont"] == pytest.approx(r["cont"], rel=1e-6, abs=0) and r["back_cont"] == r["cont"]
    fp32 = ds_zero.get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt")
    for key, value in out[0]["final"].items():
        torch.testing.assert_close(fp32[key].float(), value, rtol=0, atol=0)


# ------------------------------------------------------------------------------------ memory budget
WIDTH, LAYERS = 512, 16  # 4.2M parameters: 2.1M per rank, whose fp32 master + Adam state is 25 MB


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _held_bytes(model: nn.Module, opt: Any) -> int:
    """Bytes of every distinct storage the run holds: shards, gathered parameters, swap buffers, optimizer
    state and masters, gradient partitions (placeholders count their one element)."""
    tensors: list[torch.Tensor] = []
    for p in model.parameters():
        tensors += [p.ds_tensor, state_of(p).full_flat]
    for pool in opt.parameter_offload.param_swapper._pools.values():
        tensors += pool.buffers
    tensors += [t for buffers in opt.optimizer_swapper._sets for t in buffers.values()]
    for state in opt.optimizer.state.values():
        tensors += [v for v in state.values() if torch.is_tensor(v)]
    for part in opt.partitions:
        tensors += [t for t in (part.master, part.master.grad) if t is not None]
    tensors += [tile.master for tile in opt.tiles]
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(seen.values())


def _budget_run(rank: int, world: int, *, root: str, budget: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Tower()
    config = {
        "stage": 3,
        "sub_group_size": 65536,
        "stage3_prefetch_bucket_size": WIDTH * WIDTH,
        "stage3_max_live_parameters": WIDTH * WIDTH,
        "offload_param": {
            "device": "nvme",
            "nvme_path": root,
            "buffer_count": 2,
            "buffer_size": WIDTH * WIDTH // 2,
            "max_in_cpu": 0,
        },
        "offload_optimizer": {"device": "nvme", "nvme_path": root},
    }
    base = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt = ds_zero.DeepSpeedZeroOptimizer_Stage3(model, base, config=config)
    samples: list[int] = []
    hooks = [m.register_forward_hook(lambda *_: samples.append(_held_bytes(model, opt))) for m in model.layers]
    losses = []
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(8, WIDTH, generator=g)
        loss = model(x).pow(2).mean()
        opt.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=False)  # keep the gradient partitions: they count against the budget
        samples.append(_held_bytes(model, opt))
        losses.append(loss.item())
    for h in hooks:
        h.remove()
    state_bytes = sum(t.numel * 4 * 3 for t in opt.tiles)  # fp32 master + exp_avg + exp_avg_sq
    return {"peak": max(samples), "state_bytes": state_bytes, "losses": losses}


def test_optimizer_state_larger_than_the_memory_budget_trains_on_nvme(tmp_path: Path) -> None:
    budget = 16 * 2**20  # bytes per rank, below the 25 MB of fp32 master + Adam state each rank has
    out = run_ranks(2, _budget_run, root=str(tmp_path), budget=budget, timeout_s=120)
    for r in out:
        assert r["state_bytes"] > budget
        assert r["peak"] < budget, f"held {r['peak']} bytes, budget {budget}"
        assert r["losses"][-1] < r["losses"][0]
