"""ZeRO in your own PyTorch training loop: ds_zero + ds_comm only, no engine.

The loop below is plain PyTorch. ds_comm starts the process group from whatever launched the script;
ds_zero wraps a torch optimizer so each rank keeps only its share of the fp32 master weights and Adam
state (stage 1) and of the gradients (stage 2). With --dtype fp16 a dynamic loss scaler keeps small
gradients from underflowing: `backward()` below scales the loss, the ZeRO optimizer unscales (and
skips the step on every rank when any rank overflowed).

Run on two CPU processes (any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT works):

    torchrun --nproc_per_node 2 examples/zero_in_your_loop.py --stage 2 --dtype fp16
    deepspeed --num_gpus 2 examples/zero_in_your_loop.py --stage 2        # the ds-launcher CLI
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn

import ds_comm
import ds_zero

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def make_data(step: int, rank: int, world_size: int, batch_per_rank: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic regression task; each rank reads its own slice of the global batch."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(batch_per_rank * world_size, 32, generator=g)
    w_true = torch.linspace(-1, 1, 32 * 4).reshape(32, 4)
    y = torch.tanh(x @ w_true)
    return x[rank * batch_per_rank : (rank + 1) * batch_per_rank], y[
        rank * batch_per_rank : (rank + 1) * batch_per_rank
    ]


def backward(loss: torch.Tensor, loss_scaler: ds_zero.LossScaler) -> None:
    """Scale the loss before backward so fp16 gradients stay representable (same as `optimizer.backward`)."""
    loss_scaler.scale_loss(loss).backward()


def train(
    rank: int,
    world_size: int,
    *,
    steps: int = 40,
    stage: int = 2,
    dtype: str = "fp16",
    grad_accum: int = 2,
    lr: float = 3e-3,
) -> list[float]:
    """Train a small MLP with ZeRO; returns the loss (averaged over ranks) at every step."""
    torch.manual_seed(0)  # every rank builds the same initial model
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 4)).to(DTYPES[dtype])
    base = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    scaler = ds_zero.DynamicLossScaler(init_scale=2.0**12) if dtype == "fp16" else ds_zero.LossScaler(1.0)
    config = ds_zero.ZeroConfig(stage=stage, overlap_comm=True, reduce_bucket_size=2_000)
    optimizer = ds_zero.ZeroOptimizer(base, config=config, module=model, loss_scaler=scaler, clip_grad=1.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 5))  # warm-up

    losses = []
    for step in range(steps):
        total = torch.zeros(1)
        for micro in range(grad_accum):
            x, y = make_data(step * grad_accum + micro, rank, world_size)
            loss = nn.functional.mse_loss(model(x.to(DTYPES[dtype])).float(), y)
            backward(loss / grad_accum, scaler)  # stage 2 reduce-scatters gradients during this call
            total += loss.detach() / grad_accum
        applied = optimizer.step()  # False: an fp16 overflow somewhere, skipped everywhere
        if applied:
            schedule.step()
        ds_comm.all_reduce(total)
        losses.append(total.item() / world_size)
        if rank == 0 and step % 10 == 0:
            print(
                f"step {step:3d}  loss {losses[-1]:.4f}  loss scale {optimizer.loss_scale:g}  "
                f"grad norm {optimizer.global_grad_norm}"
            )
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", type=int, default=2, choices=[1, 2])
    parser.add_argument("--dtype", default="fp16", choices=sorted(DTYPES))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--local_rank", type=int, default=-1, help="set by some launchers; unused")
    args = parser.parse_args()
    ds_comm.init_distributed()
    losses = train(ds_comm.get_rank(), ds_comm.get_world_size(), steps=args.steps, stage=args.stage, dtype=args.dtype)
    if ds_comm.get_rank() == 0:
        print(f"final loss {losses[-1]:.4f} (first {losses[0]:.4f})")
    ds_comm.destroy_process_group()


if __name__ == "__main__":
    main()
