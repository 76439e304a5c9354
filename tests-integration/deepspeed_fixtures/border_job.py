"""One training job, run by real DeepSpeed *or* by ds: the same model, data, config and steps for both.

Modes (`python border_job.py MODE --case CASE --out DIR [...]`, one process per rank under torchrun or
`deepspeed`):

* `save`: train `STEPS_BEFORE` steps, `save_checkpoint(DIR/ckpt, client_state=...)` (ds: in the
  `--layout` given, `checkpoint.layout`), then build a
  fresh engine, `load_checkpoint` it and train `STEPS_AFTER` more steps, writing the losses and lr of
  those steps to `DIR/continuation.json`: the loader's own continuation from its checkpoint.
* `load --ckpt C`: build a fresh engine, `load_checkpoint(C)` and write the continuation as above
  (`DIR/continuation.json`). Used both ways: DeepSpeed loading a ds checkpoint, ds loading DeepSpeed's.
  With `--universal` the engine's config has `checkpoint.load_universal: true` and `C` is the folder
  holding `latest_universal` (a universal checkpoint, loadable at any world size). `--stages N` builds a
  pipeline case with N stages (the data-parallel degree is the world size over N).

The package imported is `deepspeed` unless `--engine ds` (then `ds_engine`, ds's DeepSpeed-compatible
API), so this file is the single definition of "the same job" on both sides of the border.

Data are deterministic per (step, global micro-batch index), so a run at another world size (with
gradient accumulation making up the same global batch) sees the same samples in the same steps.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
from pathlib import Path
from typing import Any

import torch

STEPS_BEFORE = 3
STEPS_AFTER = 2
MICRO_BATCH = 2
GLOBAL_MICROS = 2  # micro-batches per optimizer step over all ranks (2 ranks x gas 1, or 1 rank x gas 2)
CLIENT_STATE = {"my_counter": 7, "note": "client"}

CASES = {
    f"z{stage}_{dtype}": {"stage": stage, "dtype": dtype}
    for stage in (0, 1, 2, 3)
    for dtype in ("fp32", "bf16", "fp16")
}
# Pipeline parallelism: `PipelineModule` of Linear(4, 8), ReLU, Linear(8, 2) at PIPE_STAGES stages (data
# parallel degree 1 at 2 ranks), trained with `train_batch`; ZeRO 0 or 1 (DeepSpeed's pipeline takes no more).
PIPE_STAGES = 2
CASES.update({f"pipe_z{stage}_fp32": {"stage": stage, "dtype": "fp32", "pipe": True} for stage in (0, 1)})
# A deeper pipeline for universal checkpoints: DeepSpeed's converter needs at least one layer per stage
# between the first and the last layer files. Linear(4, 8), ReLU, Linear(8, 8), Linear(8, 2) at 2
# stages and data-parallel degree 2 (4 ranks), so each stage's optimizer state is split in two.
CASES["pipe4_z1_fp32"] = {"stage": 1, "dtype": "fp32", "pipe": True, "layers": 4, "world": 4}
# ZeRO-Offload: the optimizer state and fp32 masters on the CPU (`offload_optimizer.device: cpu`). The
# optimizer stays torch's Adam (`torch_adam: true`): DeepSpeed's CPU Adam is a compiled op its fixture
# venv does not build (DS_BUILD_OPS=0), and the checkpoint files are the same either way.
CASES.update(
    {c: {"stage": int(c[1]), "dtype": c[3:7], "offload": True} for c in ("z2_fp32_offload", "z3_bf16_offload")}
)
# What a fine-tuning job brings (`TiedFrozenNet`): a frozen layer, tied weights, parameters with fewer
# elements than ranks or a count the world size does not divide, and two param groups (decay / no decay,
# as Hugging Face's Trainer builds them). At ZeRO-3 DeepSpeed keeps the frozen layer's partitions in every
# rank's model-states file, and each param group gets its own flat group; `fp32.pt` holds what DeepSpeed's
# own `zero_to_fp32.py` makes of the checkpoint.
CASES["z3_tied_frozen_fp32"] = {"stage": 3, "dtype": "fp32", "model": "tied_frozen"}


class TinyNet(torch.nn.Module):
    """Linear(4, 8) -> ReLU -> Linear(8, 2) with a buffer: small enough for a few-KB checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.act = torch.nn.ReLU()
        self.fc2 = torch.nn.Linear(8, 2)
        self.register_buffer("buf", torch.arange(3, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x))) + self.buf.sum() * 0


class TiedFrozenNet(torch.nn.Module):
    """Linear(4, 8) -> Linear(8, 8) -> the same weight again (tied) -> a frozen Linear(8, 5) -> Linear(5, 2),
    times a one-element `scale`, with a buffer (numels 32, 8, 64, 8, 40, 5, 10, 2, 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.mid = torch.nn.Linear(8, 8)
        self.mid_tied = torch.nn.Linear(8, 8)
        self.mid_tied.weight = self.mid.weight
        self.frozen = torch.nn.Linear(8, 5)
        self.frozen.requires_grad_(False)
        self.fc2 = torch.nn.Linear(5, 2)
        self.scale = torch.nn.Parameter(torch.ones(1))
        self.register_buffer("buf", torch.arange(3, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(torch.relu(self.fc1(x))))
        h = torch.tanh(self.frozen(torch.tanh(self.mid_tied(h))))
        return self.fc2(h) * self.scale + self.buf.sum() * 0


def param_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Hugging Face's Trainer grouping: weight decay on matrices, none on biases and 1-element parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() > 1], "weight_decay": 0.01},
        {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0},
    ]


def config(
    case: str,
    world_size: int,
    stage: int | None = None,
    universal: bool = False,
    stages: int = PIPE_STAGES,
    layout: str | None = None,
) -> dict[str, Any]:
    """The DeepSpeed config of `case` at `world_size` (same global batch at every world size).

    `stage` overrides the case's ZeRO stage (loading a checkpoint into another stage); `universal` sets
    `checkpoint.load_universal`; `stages` is a pipeline case's stage count (data-parallel degree
    `world_size // stages`); `layout` sets ds's `checkpoint.layout` (DeepSpeed ignores the key).
    """
    spec = dict(CASES[case], **({} if stage is None else {"stage": stage}))
    dp = world_size // stages if spec.get("pipe") else world_size
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": GLOBAL_MICROS // dp,
        "optimizer": {"type": "Adam", "params": {"lr": 0.05, "torch_adam": True}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.05, "warmup_num_steps": 10},
        },
        "zero_optimization": {"stage": spec["stage"]},
        "steps_per_print": 1000,
    }
    if spec["dtype"] == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif spec["dtype"] == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    if spec.get("pipe"):
        # DeepSpeed 0.19.8's pipeline without ZeRO clips by the norm of the first stage's gradients only
        # (`clip_grad_norm_` with the pipe grid as mpu counts parameters on model-parallel rank 0), which
        # is not a checkpoint property: the pipeline cases train unclipped.
        cfg["gradient_clipping"] = 0.0
    if spec.get("offload") and spec["stage"] > 0:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    if layout is not None:
        cfg.setdefault("checkpoint", {})["layout"] = layout
    return cfg


def batch(step: int, micro: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Global micro-batch `micro` of optimizer step `step` (0-based over the whole run)."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randn(MICRO_BATCH, 4, generator=g)
    y = torch.randn(MICRO_BATCH, 2, generator=g)
    return x.to(dtype), y.to(dtype)


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out.float(), y.float())


def pipe_model(ds: Any, case: str = "pipe_z0_fp32", stages: int = PIPE_STAGES) -> Any:
    """TinyNet's layers (or the deeper case's) as a `PipelineModule` of `ds` at `stages` stages (layers
    built here, so every rank has the same weights)."""
    pipe = importlib.import_module(f"{ds.__name__}.pipe")
    if CASES[case].get("layers") == 4:
        layers = [torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)]
    else:
        layers = [torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)]
    return pipe.PipelineModule(layers=layers, num_stages=stages, loss_fn=_mse, partition_method="uniform")


def build(
    ds: Any,
    case: str,
    world_size: int,
    stage: int | None = None,
    universal: bool = False,
    stages: int = PIPE_STAGES,
    layout: str | None = None,
) -> Any:
    """A fresh engine of `case` (the model's initial weights are the same in every run)."""
    torch.manual_seed(0)
    if CASES[case].get("pipe"):
        model = pipe_model(ds, case, stages)
    else:
        model = TiedFrozenNet() if CASES[case].get("model") == "tied_frozen" else TinyNet()
    cfg = config(case, world_size, stage, universal, stages, layout)
    params = param_groups(model) if CASES[case].get("model") == "tied_frozen" else model.parameters()
    engine, _, _, _ = ds.initialize(model=model, model_parameters=params, config=cfg)
    return engine


def dtype_of(case: str) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[CASES[case]["dtype"]]


def train(engine: Any, first_step: int, steps: int, rank: int, world_size: int, dtype: torch.dtype) -> list[dict]:
    """`steps` optimizer steps; per step the mean loss over the global batch and the lr used."""
    if hasattr(engine, "train_batch") and type(engine).__name__ == "PipelineEngine":
        return train_pipe(engine, first_step, steps, dtype)
    gas = GLOBAL_MICROS // world_size
    out = []
    for step in range(first_step, first_step + steps):
        lr = engine.get_lr()[0]
        losses = []
        for m in range(gas):
            x, y = batch(step, rank * gas + m, dtype)
            loss = torch.nn.functional.mse_loss(engine(x).float(), y.float())
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().float())
        total = torch.stack(losses).sum()
        if torch.distributed.is_initialized() and world_size > 1:
            torch.distributed.all_reduce(total)
        out.append({"step": step, "lr": float(lr), "loss": float(total) / GLOBAL_MICROS})
    return out


def train_pipe(engine: Any, first_step: int, steps: int, dtype: torch.dtype) -> list[dict]:
    """`train` for a pipeline engine: one `train_batch` per step, each data-parallel replica feeding its
    share of the global micro-batches (`train_batch` returns the mean over all of them)."""
    dp_rank, dp = engine.grid.get_data_parallel_rank(), engine.grid.get_data_parallel_world_size()
    gas = GLOBAL_MICROS // dp
    out = []
    for step in range(first_step, first_step + steps):
        lr = engine.get_lr()[0]
        micros = [batch(step, dp_rank * gas + m, dtype) for m in range(gas)]
        loss = engine.train_batch(data_iter=iter(micros))
        out.append({"step": step, "lr": float(lr), "loss": float(loss)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "load"])
    parser.add_argument("--case", required=True, choices=sorted(CASES))
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--ckpt", type=Path)
    parser.add_argument("--engine", choices=["deepspeed", "ds"], default="deepspeed")
    parser.add_argument("--universal", action="store_true", help="load with checkpoint.load_universal")
    parser.add_argument("--stages", type=int, default=PIPE_STAGES, help="pipeline stages (pipeline cases)")
    parser.add_argument("--layout", choices=["ds", "deepspeed"], help="ds's checkpoint.layout for the save")
    args = parser.parse_args()
    if args.engine == "deepspeed":
        import deepspeed as ds
    else:
        import ds_engine as ds
    ds.init_distributed(dist_backend="gloo")
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    dtype = dtype_of(args.case)
    record: dict[str, Any] = {
        "case": args.case,
        "engine": args.engine,
        "world_size": world_size,
        "version": ds.__version__,
    }
    if CASES[args.case].get("pipe"):
        record["stages"] = args.stages
    if args.mode == "save":
        engine = build(ds, args.case, world_size, stages=args.stages, layout=args.layout)
        record["before"] = train(engine, 0, STEPS_BEFORE, rank, world_size, dtype)
        engine.save_checkpoint(str(args.out / "ckpt"), client_state=dict(CLIENT_STATE))
        ckpt = args.out / "ckpt"
        del engine
    else:
        ckpt = args.ckpt
    engine = build(ds, args.case, world_size, universal=args.universal, stages=args.stages)
    path, client = engine.load_checkpoint(str(ckpt))
    if path is None:
        raise SystemExit(f"load_checkpoint({ckpt}) loaded nothing")
    record["client_state"] = {k: client[k] for k in CLIENT_STATE if k in client}
    record["global_steps"] = engine.global_steps
    record["after"] = train(engine, engine.global_steps, STEPS_AFTER, rank, world_size, dtype)
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "continuation.json").write_text(json.dumps(record, indent=1) + "\n")
    torch.distributed.barrier()


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
