"""One rank of a Lightning `Trainer.fit` with `strategy="deepspeed_stage_2"`/`"deepspeed_stage_3"` (or DDP).

Run under `torchrun --nproc_per_node 2` (Lightning takes the processes torchrun made). A small MLP
regression LightningModule, torch AdamW, gradient clipping 1.0, 2 epochs of 4 steps, a checkpoint at the
end of each epoch (Lightning resumes a plain DataLoader at an epoch boundary, not mid-epoch);
`--resume CKPT` continues from one. Each rank writes its own per-step losses (`--summary` with the rank
appended) and a checksum of the full weights.

Lightning's DeepSpeed strategies refuse any accelerator but CUDA (`setup_environment`) and check CUDA
device indices (`setup_distributed`); this host has no GPU. `CPUDeepSpeedStrategy` lifts those two checks
and is built with the registry's own settings for the requested name, so everything else is Lightning's
`DeepSpeedStrategy` as `strategy="<name>"` makes it.
"""

from __future__ import annotations

import argparse
import json
import os

import lightning.pytorch as pl
import torch
from job_exit import leave
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DeepSpeedStrategy, StrategyRegistry
from lightning.pytorch.strategies.ddp import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

STEPS = 8


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """Lightning's DeepSpeedStrategy without its two CUDA-only checks (accelerator type, device indices)."""

    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.losses: dict[int, float] = {}

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses[self.global_step + 1] = loss.item()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 8, generator=g)
    y = (x[:, :1] * 0.5 - x[:, 1:2]).tanh() + 0.1 * torch.randn(32, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=False)


def _checksum(trainer: pl.Trainer, module: Regression) -> float:
    params = list(module.parameters())
    if any(hasattr(p, "ds_tensor") for p in params):
        import deepspeed

        with deepspeed.zero.GatheredParameters(params):
            return float(sum(p.detach().double().abs().sum() for p in params))
    return float(sum(p.detach().double().abs().sum() for p in params))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", required=True)  # "ddp", "deepspeed_stage_2", "deepspeed_stage_3"
    p.add_argument("--ckpt_dir", required=True)
    p.add_argument("--summary", required=True)
    p.add_argument("--resume", default=None)
    a = p.parse_args()

    if a.strategy == "ddp":
        strategy: object = "ddp"
    else:
        entry = StrategyRegistry[a.strategy]
        assert issubclass(entry["strategy"], DeepSpeedStrategy)
        strategy = CPUDeepSpeedStrategy(**entry["init_params"])
    checkpoints = ModelCheckpoint(
        dirpath=a.ckpt_dir, every_n_epochs=1, save_on_train_epoch_end=True, save_top_k=-1, filename="{step}"
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=STEPS,
        gradient_clip_val=1.0,
        callbacks=[checkpoints],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        deterministic=True,
    )
    module = Regression()
    trainer.fit(module, _data(), ckpt_path=a.resume)
    checksum = _checksum(trainer, module)
    rank = int(os.environ.get("RANK", "0"))
    with open(f"{a.summary}.{rank}", "w") as f:
        json.dump(
            {
                "losses": module.losses,
                "checksum": checksum,
                "global_step": trainer.global_step,
                "engine": type(trainer.strategy.model).__name__,
                "checkpoints": sorted(os.listdir(a.ckpt_dir)) if os.path.isdir(a.ckpt_dir) else [],
            },
            f,
        )
    leave()


if __name__ == "__main__":
    main()
