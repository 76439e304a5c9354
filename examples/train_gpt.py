"""Train the example GPT the way a DeepSpeed user writes it; run through the launcher:

    deepspeed --num_gpus 2 examples/train_gpt.py --deepspeed_config examples/ds_config_zero2.json

Only the import line differs from a DeepSpeed script (`import ds_engine as deepspeed`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch

import ds_engine as deepspeed

sys.path.insert(0, str(Path(__file__).parent))
from data import VOCAB, CharDataset  # noqa: E402
from gpt import GPT, GPTConfig, param_count  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Train a small GPT with ds")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps")
    parser.add_argument("--seconds", type=float, default=0, help="stop after this many seconds (0: no limit)")
    parser.add_argument("--save_dir", type=str, default="runs/gpt", help="checkpoint directory")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log_json", type=str, default="", help="append per-step losses to this JSON-lines file")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    deepspeed.init_distributed()
    torch.manual_seed(args.seed)
    with open(args.deepspeed_config) as f:
        stage = json.load(f).get("zero_optimization", {}).get("stage", 0)
    cfg = GPTConfig(vocab_size=len(VOCAB), num_layers=args.layers, dim=args.dim)
    # ZeRO-3 partitions parameters as they are created; other stages build the model whole.
    with deepspeed.zero.Init() if stage == 3 else contextlib.nullcontext():
        model = GPT(cfg)
    dataset = CharDataset(block_size=cfg.block_size)
    engine, _, loader, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(),
                                                training_data=dataset)
    rank = engine.global_rank
    if rank == 0:
        print(f"model: {param_count(model) / 1e6:.2f}M params | world {engine.world_size} | zero stage "
              f"{engine.zero_optimization_stage()} | batch {engine.train_batch_size()}", flush=True)
    start, step, samples = time.perf_counter(), 0, 0
    log = open(args.log_json, "a") if args.log_json and rank == 0 else None
    while step < args.steps:
        for x, y in loader:
            before = engine.global_steps
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            if engine.global_steps == before:  # inside a gradient accumulation window
                continue
            step = engine.global_steps
            samples = engine.global_samples
            if rank == 0 and (step % 10 == 0 or step == 1):
                rate = samples / (time.perf_counter() - start)
                print(f"step {step:4d} | loss {loss.item():.4f} | lr {engine.get_lr()[0]:.2e} | "
                      f"{rate:.1f} samples/s", flush=True)
            if log is not None:
                log.write(json.dumps({"step": step, "loss": loss.item()}) + "\n")
            if step >= args.steps or (args.seconds and time.perf_counter() - start > args.seconds):
                args.steps = step
                break
    engine.save_checkpoint(args.save_dir, client_state={"step": step})
    if rank == 0:
        print(f"saved checkpoint to {os.path.abspath(args.save_dir)} (tag global_step{step})", flush=True)


if __name__ == "__main__":
    main()
