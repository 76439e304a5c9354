"""A tiny DeepSpeed-style training script for the autotuning tests: an MLP on random data.

`--steps` optimizer steps (an autotuning experiment ends itself earlier); `--done_file` is written by
rank 0 after the last step with the batch settings the engine ran with, so a test can tell what
`--autotuning run` trained with.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn

import ds_engine as deepspeed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--done_file", type=str, default="")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    deepspeed.init_distributed()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    engine, *_ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    gen = torch.Generator().manual_seed(engine.global_rank)
    mbs = engine.train_micro_batch_size_per_gpu()
    while engine.global_steps < args.steps:
        x = torch.randn(mbs, 16, generator=gen)
        loss = nn.functional.mse_loss(engine(x), x.sum(dim=1, keepdim=True))
        engine.backward(loss)
        engine.step()
    if args.done_file and engine.global_rank == 0:
        done = {
            "steps": engine.global_steps,
            "train_micro_batch_size_per_gpu": mbs,
            "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
            "zero_stage": engine.zero_optimization_stage(),
        }
        with open(args.done_file, "w") as f:
            json.dump(done, f)


if __name__ == "__main__":
    main()
