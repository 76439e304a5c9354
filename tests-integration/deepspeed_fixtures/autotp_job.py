"""One AutoTP (`tensor_parallel.autotp_size`) training job, run by real DeepSpeed *or* by ds: the same model,
data, config and steps for both.

    python -m torch.distributed.run --nproc_per_node=N autotp_job.py MODE --case CASE --out DIR [--tp T]
        [--ckpt C] [--universal] [--engine deepspeed|ds]

* `save`: at TP=`--tp` (default 2) train `STEPS_BEFORE` steps and `save_checkpoint(DIR/ckpt, client_state=...)`.
* `load --ckpt C`: build a fresh engine at TP=`--tp` (1: no tensor parallelism) on N ranks, load `C` (with
  `--universal`: `checkpoint.load_universal`, `C` holding `latest_universal`), train `STEPS_AFTER` steps
  and write their losses and lr to `DIR/continuation_tp{T}_world{N}.json`.

The model is small enough for a few-KB checkpoint and is one that both AutoTPs shard alike with their
automatic policy (no transformers model needed, though DeepSpeed's AutoTP imports transformers): a
`ModuleList` of one block whose `q_proj` is column-parallel and `o_proj` row-parallel (its bias stays
replicated), a LayerNorm and an output head every rank holds whole. The class name ends in `Model`, which
DeepSpeed's policy detection requires. Every step sees the same global batch (`GLOBAL_MICROS`
micro-batches split over the data-parallel replicas), so runs at different layouts compare step for step.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

STEPS_BEFORE, STEPS_AFTER = 3, 2
MICRO, GLOBAL_MICROS, HIDDEN = 2, 2, 8
CLIENT_STATE = {"my_counter": 7}
CASES = {"autotp_z1_fp32": {"stage": 1}}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.o_proj = nn.Linear(2 * HIDDEN, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.o_proj(torch.relu(self.q_proj(x))))


class TinyTPModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block()])
        self.head = nn.Linear(HIDDEN, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def config(case: str, tp: int, world: int, universal: bool = False) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GLOBAL_MICROS // (world // tp),
        "optimizer": {"type": "Adam", "params": {"lr": 0.05, "torch_adam": True}},
        "zero_optimization": {"stage": CASES[case]["stage"]},
        "steps_per_print": 1000,
    }
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def build(ds: Any, case: str, tp: int, world: int, universal: bool = False) -> Any:
    torch.manual_seed(0)
    model = TinyTPModel()
    engine, *_ = ds.initialize(
        model=model, model_parameters=model.parameters(), config=config(case, tp, world, universal)
    )
    return engine


def batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(MICRO, HIDDEN, generator=g), torch.randn(MICRO, 2, generator=g)


def train(engine: Any, first: int, steps: int, rank: int, tp: int, world: int) -> list[dict[str, Any]]:
    """Per step the lr and the mean loss over the global batch (tensor-parallel ranks repeat their replica's)."""
    gas = GLOBAL_MICROS // (world // tp)
    replica = rank // tp  # tensor-parallel ranks are consecutive in both engines' meshes
    out = []
    for step in range(first, first + steps):
        lr = engine.get_lr()[0]
        total = torch.zeros(())
        for m in range(gas):
            x, y = batch(step, replica * gas + m)
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        torch.distributed.all_reduce(total)
        out.append({"step": step, "lr": float(lr), "loss": float(total) / (world * gas)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "load"])
    parser.add_argument("--case", required=True, choices=sorted(CASES))
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--ckpt", type=Path)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--universal", action="store_true")
    parser.add_argument("--engine", choices=["deepspeed", "ds"], default="deepspeed")
    args = parser.parse_args()
    if args.engine == "deepspeed":
        import deepspeed as ds
    else:
        import ds_engine as ds
    ds.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    engine = build(ds, args.case, args.tp, world, universal=args.universal and args.mode == "load")
    if args.mode == "save":
        train(engine, 0, STEPS_BEFORE, rank, args.tp, world)
        engine.save_checkpoint(str(args.out / "ckpt"), client_state=dict(CLIENT_STATE))
    else:
        path, client = engine.load_checkpoint(str(args.ckpt))
        if path is None:
            raise SystemExit(f"load_checkpoint({args.ckpt}) loaded nothing")
        record = {
            "case": args.case,
            "engine": args.engine,
            "version": ds.__version__,
            "tp": args.tp,
            "world_size": world,
            "global_steps": engine.global_steps,
            "client_state": {k: client[k] for k in CLIENT_STATE if k in client},
            "after": train(engine, engine.global_steps, STEPS_AFTER, rank, args.tp, world),
        }
        if rank == 0:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"continuation_tp{args.tp}_world{world}.json").write_text(json.dumps(record, indent=1) + "\n")
    torch.distributed.barrier()


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
