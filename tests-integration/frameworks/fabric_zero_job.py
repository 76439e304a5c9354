"""One rank of a Lightning Fabric loop that shards with ds-zero directly: no engine, no `deepspeed`.

Run under `torchrun --nproc_per_node 2`. Fabric starts the process group and shards the data; with
`--zero STAGE` the model stays unwrapped and `ds_zero.ZeroOptimizer` (stage 1 or 2) partitions the
AdamW state and reduces the gradients itself; without it, the reference: Fabric's own DDP
(`fabric.setup(model, optimizer)`). Same MLP, data, clipping (1.0) and steps. Rank 0 writes the
global-mean loss per step, a weight checksum, and which ds/DeepSpeed modules were imported.
"""

from __future__ import annotations

import argparse
import json
import sys

import lightning.fabric as lf
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

STEPS = 8


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2])
    p.add_argument("--summary", required=True)
    a = p.parse_args()

    fabric = lf.Fabric(accelerator="cpu", devices=2, strategy="ddp")
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

        optimizer = ds_zero.ZeroOptimizer(base, config=ds_zero.ZeroConfig(stage=a.zero, reduce_bucket_size=64),
                                          module=model, clip_grad=1.0)
    else:
        model, optimizer = fabric.setup(model, base)

    losses = []
    for xb, yb in loader:
        loss = nn.functional.mse_loss(model(xb), yb)
        if a.zero:
            loss.backward()  # stage 2 reduce-scatters the gradients during backward
        else:
            fabric.backward(loss)
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
    assert len(losses) == STEPS, len(losses)
    checksum = float(sum(q.detach().double().abs().sum() for q in model.parameters()))
    if fabric.global_rank == 0:
        with open(a.summary, "w") as f:
            json.dump({"losses": losses, "checksum": checksum,
                       "imported": sorted(m for m in ("ds_engine", "deepspeed", "ds_zero") if m in sys.modules)}, f)
    fabric.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
