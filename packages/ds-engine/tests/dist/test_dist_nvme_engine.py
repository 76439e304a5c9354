"""NVMe offload (ZeRO-Infinity) through the engine on 2 gloo ranks: the config's `aio` section reaches ds-zero.

Stage 3 with `offload_param.device="nvme"` (a directory on this disk) and a non-default `aio` section
trains like stage 3 without offload (losses and weights to 1e-6 over 3 steps) and writes its swap
files there; without an optimizer (evaluation) it gives the unpartitioned model's outputs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ds_comm.testing import run_ranks

ds_zero = pytest.importorskip("ds_zero", reason="NVMe offload needs ds-zero: pip install 'ds-engine[zero]'")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(10, 40), nn.Tanh(), nn.Linear(40, 40), nn.Tanh(), nn.Linear(40, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _config(nvme_path: str | None, optimizer: bool = True) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if nvme_path is not None:
        zero["offload_param"] = {
            "device": "nvme",
            "nvme_path": nvme_path,
            "buffer_count": 4,
            "buffer_size": 4096,
            "max_in_cpu": 0,
        }
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": zero}
    if nvme_path is not None:
        cfg["aio"] = {"block_size": 65536, "queue_depth": 4, "intra_op_parallelism": 2}
    if optimizer:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}
    return cfg


def _data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 10, generator=g), torch.randn(4, 3, generator=g)


def _train(rank: int, config: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    import ds_engine as deepspeed

    torch.manual_seed(0)
    model = Net()
    engine, *_ = deepspeed.initialize(model=model, config=config)
    losses = []
    for step in range(3):
        x, y = _data(rank, step)
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        weights = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    return torch.tensor(losses), weights


def _nvme_run(rank: int, world: int, root: str) -> dict[str, Any]:
    import ds_engine as deepspeed

    plain = _train(rank, _config(None))
    nvme = _train(rank, _config(f"{root}/train"))
    torch.manual_seed(0)
    model = Net()
    engine, optimizer, *_ = deepspeed.initialize(model=model, config=_config(f"{root}/eval", optimizer=False))
    with torch.no_grad():
        out = engine(_data(0, 9)[0])
    return {
        "plain": plain,
        "nvme": nvme,
        "eval": out,
        "optimizer": optimizer,
        "files": sorted(str(p.relative_to(root)) for p in Path(root).rglob("*") if p.is_file()),
    }


def test_nvme_param_offload_through_the_engine(tmp_path: Path) -> None:
    torch.manual_seed(0)
    reference = Net()
    with torch.no_grad():
        expected = reference(_data(0, 9)[0])
    for sub in ("train", "eval"):
        (tmp_path / sub).mkdir()
    results = run_ranks(2, _nvme_run, root=str(tmp_path), timeout_s=180)
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["nvme"][0], r["plain"][0], rtol=1e-6, atol=1e-6, msg=f"rank {rank} losses")
        torch.testing.assert_close(r["nvme"][1], r["plain"][1], rtol=1e-6, atol=1e-6, msg=f"rank {rank} weights")
        torch.testing.assert_close(r["eval"], expected, rtol=0, atol=1e-6, msg=f"rank {rank} eval")
        assert r["optimizer"] is None
    files = results[0]["files"]
    assert any(f.startswith("train/") for f in files) and any(f.startswith("eval/") for f in files), files


def _bf16_config(nvme_path: str | None, gas: int) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 500}
    if nvme_path is not None:
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 4, "buffer_size": 4096}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path, "pipeline_read": gas == 1}
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0,
        "bf16": {"enabled": True, "check_grad_overflow": False},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": zero,
    }


def _bf16_train(rank: int, config: dict[str, Any], gas: int) -> tuple[list[float], torch.Tensor, int]:
    import ds_engine as deepspeed

    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=Net(), config=config)
    losses, eager = [], 0
    for step in range(4 * gas):
        x, y = _data(rank, step)
        loss = nn.functional.mse_loss(engine(x.to(torch.bfloat16)).float(), y)
        engine.backward(loss)
        swapper = getattr(engine.optimizer, "optimizer_swapper", None)
        if swapper is not None and swapper.grads.eager is not None:
            eager += len(swapper.grads.eager.stepped)  # sub-groups updated during this backward
        engine.step()
        losses.append(loss.item())
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        weights = torch.cat([p.detach().float().reshape(-1).clone() for p in engine.module.parameters()])
    return losses, weights, eager


def _eager_run(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for gas in (1, 2):
        out[gas] = (
            _bf16_train(rank, _bf16_config(None, gas), gas),
            _bf16_train(rank, _bf16_config(f"{root}/g{gas}", gas), gas),
        )
    return out


def test_nvme_steps_sub_groups_during_backward_and_matches_in_memory_training(tmp_path: Path) -> None:
    """bf16 without the overflow check and without clipping: ZeRO-Infinity updates each sub-group as its
    gradient completes in backward (from the second step, once the completion order is known); the
    losses and weights equal stage 3 without offload, with and without gradient accumulation."""
    for gas in (1, 2):
        (tmp_path / f"g{gas}").mkdir()
    results = run_ranks(2, _eager_run, root=str(tmp_path), timeout_s=240)
    for rank, r in enumerate(results):
        for gas in (1, 2):
            (plain_losses, plain_weights, _), (losses, weights, eager) = r[gas]
            assert losses == pytest.approx(plain_losses, rel=1e-6, abs=1e-7), f"rank {rank} gas {gas}"
            torch.testing.assert_close(weights, plain_weights, rtol=0, atol=0, msg=f"rank {rank} gas {gas}")
            assert eager > 0, f"rank {rank} gas {gas}: no sub-group was updated during backward"
