"""Train the example GPT the way a DeepSpeed user writes it; run through the launcher:

    deepspeed --num_gpus 2 examples/train_gpt.py --deepspeed_config examples/ds_config_zero2.json

Only the import line differs from a DeepSpeed script (`import ds_engine as deepspeed`).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed

import ds_engine as deepspeed

sys.path.insert(0, str(Path(__file__).parent))
from data import VOCAB, CharDataset  # noqa: E402
from gpt import GPT, Embedding, GPTConfig, lm_loss, param_count  # noqa: E402


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
    parser.add_argument("--load_dir", type=str, default="", help="resume from the latest checkpoint here")
    parser.add_argument("--save_every", type=int, default=0, help="also save a checkpoint every K steps")
    parser.add_argument(
        "--pipeline_stages", type=int, default=0, help="train as a PipelineModule of this many stages (0: no pipeline)"
    )
    # Test hooks (tests-integration): a rank that dies mid-run, and where each rank writes its pid.
    parser.add_argument("--die_at_step", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--die_rank", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--die_code", type=int, default=3, help=argparse.SUPPRESS)
    parser.add_argument("--pid_dir", type=str, default="", help=argparse.SUPPRESS)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    deepspeed.init_distributed()
    torch.manual_seed(args.seed)
    with open(args.deepspeed_config) as f:
        stage = json.load(f).get("zero_optimization", {}).get("stage", 0)
    cfg = GPTConfig(vocab_size=len(VOCAB), num_layers=args.layers, dim=args.dim)
    if args.pipeline_stages:
        model = pipeline_gpt(cfg, args.pipeline_stages)
    else:
        # ZeRO-3 partitions parameters as they are created; other stages build the model whole.
        with deepspeed.zero.Init() if stage == 3 else contextlib.nullcontext():
            model = GPT(cfg)
    dataset = CharDataset(block_size=cfg.block_size)
    engine, _, loader, _ = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=dataset
    )
    rank = engine.global_rank
    if args.pid_dir:
        Path(args.pid_dir, f"rank{rank}.pid").write_text(str(os.getpid()))
    if rank == 0:
        print(
            f"model: {param_count(model) / 1e6:.2f}M params | world {engine.world_size} | zero stage "
            f"{engine.zero_optimization_stage()} | batch {engine.train_batch_size()}",
            flush=True,
        )
    skip = 0
    if args.load_dir:
        path, _ = engine.load_checkpoint(args.load_dir)
        skip = _consumed_batches(engine)
        if rank == 0:
            print(f"resumed from {path} at step {engine.global_steps}", flush=True)
    eval_x, eval_y = (torch.stack(t) for t in zip(*(dataset[i] for i in range(16)), strict=True))
    start, step, samples = time.perf_counter(), engine.global_steps, 0
    log = open(args.log_json, "a") if args.log_json and rank == 0 else None
    batches = _batches(loader, skip)
    while step < args.steps:
        if args.die_at_step and step + 1 == args.die_at_step and rank == args.die_rank:
            if args.pid_dir:
                Path(args.pid_dir, "died_at").write_text(repr(time.time()))
            os._exit(args.die_code)
        if args.pipeline_stages:
            loss = engine.train_batch(batches)  # gradient_accumulation_steps micro batches, one step
        else:
            before = engine.global_steps
            loss = engine(*next(batches))
            engine.backward(loss)
            engine.step()
            if engine.global_steps == before:  # inside a gradient accumulation window
                continue
        step = engine.global_steps
        samples = engine.global_samples
        if rank == 0 and (step % 10 == 0 or step == 1):
            rate = samples / (time.perf_counter() - start)
            print(
                f"step {step:4d} | loss {loss.item():.4f} | lr {engine.get_lr()[0]:.2e} | {rate:.1f} samples/s",
                flush=True,
            )
        if log is not None:
            log.write(json.dumps({"step": step, "loss": loss.item()}) + "\n")
            log.flush()
        if args.seconds and _out_of_time(start, args.seconds):
            break
        if args.save_every and step % args.save_every == 0 and step < args.steps:
            _save(engine, args.save_dir, step, eval_x, eval_y, log)
    _save(engine, args.save_dir, step, eval_x, eval_y, log)
    if rank == 0:
        print(f"saved checkpoint to {os.path.abspath(args.save_dir)} (tag global_step{step})", flush=True)


def _out_of_time(start: float, seconds: float) -> bool:
    """Whether the time budget is spent, agreed by every rank: each rank's own clock would let one stop a step
    before another, leaving its peers waiting in the next step's collectives while it saves (a hang)."""
    spent = torch.tensor([float(time.perf_counter() - start > seconds)])
    torch.distributed.all_reduce(spent, op=torch.distributed.ReduceOp.MAX)
    return bool(spent.item())


def pipeline_gpt(cfg: GPTConfig, num_stages: int) -> torch.nn.Module:
    """The GPT as a PipelineModule: embedding, blocks, final norm, and the output head tied to the embedding.

    The whole GPT is built first (tiny here) so the pipeline starts from exactly the weights `GPT(cfg)`
    gets under the same seed; the tied embedding, built by each owning stage, is then overwritten with them.
    """
    if not cfg.tie_embeddings:
        raise ValueError("pipeline_gpt: expects tie_embeddings=True (the head reuses the token embedding)")
    TiedLayerSpec = deepspeed.pipe.TiedLayerSpec  # noqa: N806 - a class

    gpt = GPT(cfg)
    layers = [
        TiedLayerSpec("embed", Embedding, cfg, tied_weight_attr="tok.weight"),
        *gpt.blocks,
        gpt.head.ln,
        TiedLayerSpec("embed", Embedding, cfg, forward_fn=_tied_logits, tied_weight_attr="tok.weight"),
    ]
    model = deepspeed.PipelineModule(layers=layers, num_stages=num_stages, loss_fn=lm_loss, partition_method="uniform")
    if "embed" in model.tied_modules:
        model.tied_modules["embed"].load_state_dict(gpt.embed.state_dict())
    return model


def _tied_logits(embedding: Embedding, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, embedding.tok.weight)


def _batches(loader: Any, skip: int) -> Iterator[Any]:
    """The loader's batches, epoch after epoch, leaving out the first `skip` (consumed before a resume)."""
    yield from itertools.islice(loader, skip, None)
    while True:
        yield from loader


def _consumed_batches(engine: deepspeed.DeepSpeedEngine) -> int:
    """Loader batches this rank skips after a resume: the samples the checkpointed run trained on.

    The DistributedSampler deals one order (shuffled; in order under a PipelineEngine) round-robin, so the
    first `global_samples` samples of that order are the first `global_samples / (micro batch * dp ranks)`
    batches of every rank, whatever the world size of the run that saved them.
    """
    per_step = engine.train_micro_batch_size_per_gpu() * engine.dp_world_size
    if engine.global_samples % per_step:
        raise ValueError(
            f"cannot resume: {engine.global_samples} samples consumed is not a multiple of "
            f"{per_step} (micro batch x data-parallel ranks); resume with a world size that divides it"
        )
    return engine.global_samples // per_step


def _save(
    engine: deepspeed.DeepSpeedEngine, save_dir: str, step: int, eval_x: torch.Tensor, eval_y: torch.Tensor, log: Any
) -> None:
    """Log the loss on a fixed held-out batch (so a consolidated checkpoint can be checked), then save."""
    if isinstance(engine, deepspeed.PipelineEngine):
        micro = engine.train_micro_batch_size_per_gpu()
        chunks = list(zip(eval_x.split(micro), eval_y.split(micro), strict=True))
        eval_loss = engine.eval_batch(iter(chunks), num_micro_batches=len(chunks)).item()
    else:
        engine.eval()
        with torch.no_grad():
            eval_loss = engine(eval_x, eval_y).item()
        engine.train()
    if log is not None:
        log.write(json.dumps({"step": step, "eval_loss": eval_loss}) + "\n")
        log.flush()
    engine.save_checkpoint(save_dir, client_state={"step": step})


if __name__ == "__main__":
    main()
