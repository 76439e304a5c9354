"""One rank of a Lightning Fabric loop: ds-zero directly, Fabric's DeepSpeed strategy, or Fabric's DDP.

Run under `torchrun --nproc_per_node 2`. Fabric starts the process group and shards the data.
`--zero STAGE`: the model stays unwrapped and `ds_zero.ZeroOptimizer` (stage 1 or 2) partitions the
AdamW state and reduces the gradients itself (no engine, no `deepspeed`). `--deepspeed STAGE`: Fabric's
`DeepSpeedStrategy` (through the `deepspeed` distribution), with `fabric.save` after step 4 and, at the
end, `fabric.load` of it and steps 5-8 again. Neither: the reference, Fabric's own DDP. Same MLP,
data, clipping (1.0) and steps. Rank 0 writes the global-mean loss per step, a weight checksum, and
which ds/DeepSpeed modules were imported.

Fabric's DeepSpeedStrategy refuses non-CUDA accelerators and checks CUDA device indices; this host has
no GPU, so `CPUDeepSpeedStrategy` lifts exactly those two checks.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import lightning.fabric as lf
import torch
from job_exit import leave
from lightning.fabric.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.fabric.utilities.seed import reset_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

STEPS, SAVE_AT = 8, 4


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """Fabric's DeepSpeedStrategy without its two CUDA-only checks (accelerator type, device indices)."""

    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)

    def _setup_distributed(self) -> None:
        reset_seed()
        self._set_world_ranks()
        self._init_deepspeed_distributed()
        if not self._config_initialized:
            self._format_config()
            self._config_initialized = True


def _checksum(model: nn.Module) -> float:
    params = list(model.parameters())
    if any(hasattr(q, "ds_tensor") for q in params):  # ZeRO-3: gather the shards first
        import deepspeed

        with deepspeed.zero.GatheredParameters(params):
            return float(sum(q.detach().double().abs().sum() for q in params))
    return float(sum(q.detach().double().abs().sum() for q in params))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2])
    p.add_argument("--deepspeed", type=int, default=0, choices=[0, 2, 3])
    p.add_argument("--ckpt", default=None)
    p.add_argument("--summary", required=True)
    a = p.parse_args()

    strategy: object = "ddp"
    if a.deepspeed:
        strategy = CPUDeepSpeedStrategy(
            config={
                "train_micro_batch_size_per_gpu": 4,
                "gradient_clipping": 1.0,
                # stage 3: partition even these small parameters
                "zero_optimization": {"stage": a.deepspeed, "stage3_param_persistence_threshold": 0},
            }
        )
    fabric = lf.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    y = (x[:, :1] * 0.5 - x[:, 1:2]).tanh() + 0.1 * torch.randn(64, 1, generator=g)
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(x, y), batch_size=4, shuffle=False))
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    base = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    if a.zero:
        import ds_zero

        optimizer = ds_zero.ZeroOptimizer(
            base, config=ds_zero.ZeroConfig(stage=a.zero, reduce_bucket_size=64), module=model, clip_grad=1.0
        )
    else:
        model, optimizer = fabric.setup(model, base)

    batches = list(loader)
    assert len(batches) == STEPS, len(batches)

    def train(steps: range) -> list[float]:
        losses = []
        for i in steps:
            xb, yb = batches[i]
            loss = nn.functional.mse_loss(model(xb), yb)
            if a.zero:
                loss.backward()  # stage 2 reduce-scatters the gradients during backward
            else:
                fabric.backward(loss)
                if not a.deepspeed:  # DeepSpeed clips inside its step (gradient_clipping)
                    fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
            if a.ckpt and i + 1 == SAVE_AT:
                fabric.save(a.ckpt, {"model": model, "optimizer": optimizer, "step": i + 1})
        return losses

    losses = train(range(STEPS))
    summary = {
        "losses": losses,
        "checksum": _checksum(model),
        # ZeRO-3: every parameter is this rank's 1/2 shard (a 1-element bias: the element on each)
        "partitioned": all(
            hasattr(q, "ds_tensor") and q.ds_tensor.numel() == math.ceil(q.ds_numel / 2) for q in model.parameters()
        ),
    }
    if a.ckpt:
        state = {"model": model, "optimizer": optimizer, "step": 0}
        fabric.load(a.ckpt, state)
        summary.update(
            step_loaded=state["step"],
            losses_after_load=train(range(SAVE_AT, STEPS)),
            checksum_after_load=_checksum(model),
        )
    summary["imported"] = sorted(m for m in ("ds_engine", "deepspeed", "ds_zero") if m in sys.modules)
    if fabric.global_rank == 0:
        with open(a.summary, "w") as f:
            json.dump(summary, f)
    leave()


if __name__ == "__main__":
    main()
