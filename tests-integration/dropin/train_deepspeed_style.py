"""A training script written against DeepSpeed's documented API; the only change is the import line.

Everything below `import ds_engine as deepspeed` is what a DeepSpeed user writes (the getting-started
tutorial's shape): argparse with `deepspeed.add_config_arguments`, `deepspeed.initialize(args=...)`,
`loss = model_engine(batch)`, `model_engine.backward(loss)`, `model_engine.step()`,
`save_checkpoint(dir, client_state=...)`, `load_checkpoint(dir)` returning `(path, client_state)`.

Run as `deepspeed --num_gpus 2 train_deepspeed_style.py --deepspeed --deepspeed_config ds_config.json
--save_dir DIR --out RESULT.json [--resume_tag TAG]`. Rank 0 writes what the integration test checks.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn
from torch.utils.data import TensorDataset

import ds_engine as deepspeed  # was: import deepspeed
import ds_engine.comm as dist  # was: import deepspeed.comm as dist
from ds_engine.accelerator import get_accelerator  # was: from deepspeed.accelerator import get_accelerator


class Net(nn.Module):
    """A small regression net whose forward returns the loss, as the tutorials' models do."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.body(x).float(), y.float())


def make_dataset() -> TensorDataset:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(512, 16, generator=gen)
    y = x[:, :4].sum(dim=1, keepdim=True).sin() + 0.1 * x[:, 4:5]
    return TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser(description="DeepSpeed-style training")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save_at", type=int, default=4, help="also save a checkpoint after this step")
    parser.add_argument("--save_dir", type=str, required=True)
    parser.add_argument("--resume_tag", type=str, default=None, help="load this tag before training")
    parser.add_argument("--out", type=str, required=True)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed()
    torch.manual_seed(42)
    model = Net()
    model_engine, optimizer, trainloader, _ = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=make_dataset()
    )
    device = torch.device(get_accelerator().device_name(model_engine.local_rank))
    dtype = torch.half if model_engine.fp16_enabled() else torch.float

    start, loaded = 0, None
    if args.resume_tag is not None:
        load_path, client_state = model_engine.load_checkpoint(args.save_dir, tag=args.resume_tag)
        assert load_path is not None, "checkpoint not found"
        start = client_state["step"]
        loaded = {key: client_state[key] for key in ("step", "note", "losses")}

    losses: dict[int, float] = {}
    step = 0
    for x, y in trainloader:
        step += 1
        if step <= start:  # skip what the checkpointed run already consumed
            continue
        loss = model_engine(x.to(device, dtype), y.to(device))
        model_engine.backward(loss)
        model_engine.step()
        losses[step] = loss.item()
        if step == args.save_at:
            model_engine.save_checkpoint(
                args.save_dir, client_state={"step": step, "note": "resume here", "losses": dict(losses)}
            )
        if step >= args.steps:
            break

    if dist.get_rank() == 0:
        result = {
            "losses": losses,
            "client_state": loaded,
            "global_steps": model_engine.global_steps,
            "module_type": type(model_engine.module).__name__,
            "local_rank": model_engine.local_rank,
            "world_size": model_engine.world_size,
            "lr": model_engine.get_lr()[0],
            "fp16": model_engine.fp16_enabled(),
            "zero_stage": model_engine.zero_optimization_stage(),
            "param_sum": sum(p.detach().float().sum().item() for p in model_engine.module.parameters()),
        }
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
