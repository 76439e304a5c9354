"""One rank of a plain Accelerate training loop: `Accelerator(deepspeed_plugin=DeepSpeedPlugin(ds_config))`.

Run under `torchrun --nproc_per_node 2`. With `--ds_config` Accelerate drives `deepspeed` (ds here);
without it, plain PyTorch DDP on the CPU. A small MLP regression, torch AdamW and a LambdaLR warmup,
8 steps; `save_state` after step 4, then at the end `load_state` of that directory and steps 5-8 again.
Rank 0 writes the losses of both passes and checksums of the weights.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from accelerate import Accelerator, DeepSpeedPlugin
from accelerate.utils import InitProcessGroupKwargs
from job_exit import leave
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

STEPS, SAVE_AT = 8, 4


def _checksum(acc: Accelerator, model: nn.Module) -> float:
    params = list(acc.unwrap_model(model).parameters())
    if acc.state.deepspeed_plugin is not None and any(hasattr(p, "ds_tensor") for p in params):
        import deepspeed

        with deepspeed.zero.GatheredParameters(params):
            return float(sum(p.detach().double().abs().sum() for p in params))
    return float(sum(p.detach().double().abs().sum() for p in params))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ds_config", default=None)
    p.add_argument("--state_dir", required=True)
    p.add_argument("--summary", required=True)
    a = p.parse_args()

    if a.ds_config:
        # This host has no accelerator device: name gloo, or Accelerate would see no distributed backend at all.
        acc = Accelerator(
            deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=a.ds_config),
            kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")],
        )
    else:  # the reference: DDP over gloo on the CPU
        acc = Accelerator(cpu=True)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    y = (x[:, :1] * 0.5 - x[:, 1:2]).tanh() + 0.1 * torch.randn(64, 1, generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=False)
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 3))
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    batches = list(loader)
    assert len(batches) == STEPS, len(batches)

    def train(steps: range) -> list[float]:
        losses = []
        for i in steps:
            xb, yb = batches[i]
            loss = nn.functional.mse_loss(model(xb), yb)
            acc.backward(loss)
            # DDP: clips here; DeepSpeed: the engine already clipped (ds_config gradient_clipping) in backward.
            acc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(acc.gather(loss.detach().reshape(1)).mean().item())
            if i + 1 == SAVE_AT:
                acc.save_state(a.state_dir)
        return losses

    first = train(range(STEPS))
    end = _checksum(acc, model)
    acc.load_state(a.state_dir)
    at_save = _checksum(acc, model)
    again = train(range(SAVE_AT, STEPS))
    if int(os.environ.get("RANK", "0")) == 0:
        with open(a.summary, "w") as f:
            json.dump(
                {
                    "losses": first,
                    "losses_after_load": again,
                    "checksum": end,
                    "checksum_at_load": at_save,
                    "checksum_after_load": _checksum(acc, model),
                    "distributed_type": str(acc.distributed_type),
                },
                f,
            )
    leave()


if __name__ == "__main__":
    main()
