"""Loss curves of the example GPT under torch DDP, ds-engine ZeRO 1/2/3 and a 2-stage pipeline: same seed, same data.

    python benchmarks/loss_curves.py [--steps 40] [--out-dir benchmarks] [--json PATH]

Each mode trains `examples/gpt.py`'s GPT (4 layers, width 128 by default) from the same initial
weights on 2 gloo ranks for `--steps` optimizer steps, on the same global batches of 16 windows of
`examples/data.py`'s corpus: torch DDP + torch AdamW (the baseline); `ds_engine.initialize` with
ZeRO stage 1, 2 and 3 (stage 3 built under `zero.Init`, as `examples/train_gpt.py` does), where each
rank takes 8 of the 16; and a `PipelineModule` of 2 stages (`train_gpt.pipeline_gpt`, tied
embedding) that takes the 16 as 2 micro-batches of 8. All use fp32, AdamW (torch's, `torch_adam`)
with a constant lr, and gradient clipping to norm 1.0, so every mode computes the same update and
only summation order differs. The recorded loss of a step is the mean over its 16 windows.

Writes `loss_curves.csv` (one column per mode) and `loss_curves.svg` (the curves, and each mode's
|loss - DDP loss| per step on a log scale) to `--out-dir`, prints the divergence per mode, and with
`--json` one row per mode: the largest |loss - DDP loss| over the run, target <= 1e-4 (fp32: the
modes reduce gradients in different orders, so they agree to rounding, not bit for bit; the
difference grows slowly with the steps as rounding compounds).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import sys
import time
import warnings
from pathlib import Path

import _report
import _svg_plot
import torch
from torch.nn.parallel import DistributedDataParallel

import ds_comm
import ds_engine
from ds_comm.testing import run_ranks

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
from data import VOCAB, CharDataset  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402
from train_gpt import pipeline_gpt  # noqa: E402

MODES = {
    "ddp": "torch DDP + AdamW",
    "zero1": "ZeRO-1",
    "zero2": "ZeRO-2",
    "zero3": "ZeRO-3",
    "pipe": "pipeline, 2 stages",
}
WORLD, MICRO = 2, 8
LR, BETAS, WEIGHT_DECAY, CLIP = 1e-3, (0.9, 0.95), 0.01, 1.0
TOLERANCE = "1e-4"


def _global_batches(cfg: GPTConfig, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` global batches of WORLD * MICRO windows, drawn from one fixed permutation of the corpus."""
    dataset = CharDataset(block_size=cfg.block_size)
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0))
    per_step = WORLD * MICRO
    if steps * per_step > len(dataset):
        raise ValueError(f"--steps {steps} needs {steps * per_step} windows; the corpus has {len(dataset)}")
    out = []
    for step in range(steps):
        items = [dataset[int(i)] for i in order[step * per_step : (step + 1) * per_step]]
        out.append((torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])))
    return out


def _config(mode: str) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": CLIP,
        "steps_per_print": 10**9,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "betas": list(BETAS), "weight_decay": WEIGHT_DECAY, "torch_adam": True},
        },
    }
    if mode == "pipe":  # one pipeline of 2 stages: no data parallelism, the 16 windows as 2 micro-batches
        config["gradient_accumulation_steps"] = WORLD
    else:
        config["zero_optimization"] = {"stage": int(mode.removeprefix("zero"))}
    return config


def _mean_over_ranks(loss: torch.Tensor) -> float:
    value = loss.detach().clone()
    ds_comm.all_reduce(value)
    return value.item() / ds_comm.get_world_size()


def _train(rank: int, world: int, mode: str, steps: int, layers: int, dim: int) -> dict:
    """One mode's per-step losses (the mean over the step's global batch) and its wall time."""
    # torch 2.13 deprecates the *_tensor collectives ds_comm wraps; one warning per call site is noise here.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    cfg = GPTConfig(vocab_size=len(VOCAB), num_layers=layers, dim=dim)
    batches = _global_batches(cfg, steps)
    torch.manual_seed(0)
    losses = []
    started = time.perf_counter()
    if mode == "ddp":
        model = DistributedDataParallel(GPT(cfg))
        opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
        for x, y in batches:
            loss = model(x[rank::world], y[rank::world])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(_mean_over_ranks(loss))
    elif mode == "pipe":
        engine, *_ = ds_engine.initialize(model=pipeline_gpt(cfg, num_stages=world), config=_config(mode))
        for x, y in batches:
            micro_batches = [(x[j::WORLD], y[j::WORLD]) for j in range(WORLD)]
            losses.append(engine.train_batch(iter(micro_batches)).item())
    else:
        with ds_engine.zero.Init() if mode == "zero3" else contextlib.nullcontext():
            model = GPT(cfg)
        engine, *_ = ds_engine.initialize(model=model, model_parameters=model.parameters(), config=_config(mode))
        for x, y in batches:
            loss = engine(x[rank::world], y[rank::world])
            engine.backward(loss)
            engine.step()
            losses.append(_mean_over_ranks(loss))
    return {"losses": losses, "seconds": time.perf_counter() - started}


def _write_csv(path: Path, curves: dict[str, list[float]]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", *curves])
        for i, row in enumerate(zip(*curves.values(), strict=True)):
            writer.writerow([i + 1, *(f"{v:.9g}" for v in row)])


def _plot(curves: dict[str, list[float]], steps: int) -> str:
    xs = list(range(1, steps + 1))
    ddp = curves["ddp"]
    loss = _svg_plot.Panel(
        "training loss",
        "step",
        "loss (mean over the global batch)",
        [_svg_plot.Series(MODES[m], xs, c) for m, c in curves.items()],
    )
    diff = _svg_plot.Panel(
        "|loss - DDP loss|",
        "step",
        "absolute difference",
        [
            _svg_plot.Series(MODES[m], xs, [abs(a - b) for a, b in zip(c, ddp, strict=True)])
            for m, c in curves.items()
            if m != "ddp"
        ],
        log_y=True,
    )
    return _svg_plot.render([loss, diff], title=f"Example GPT on {WORLD} gloo ranks, fp32, same seed and batches")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {','.join(MODES)}")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent)
    _report.add_json_argument(parser)
    args = parser.parse_args()
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown or "ddp" not in modes:
        parser.error(f"--modes {args.modes!r}: unknown {unknown}; choose from {list(MODES)}, including ddp")
    curves, seconds = {}, {}
    for mode in modes:
        result = run_ranks(WORLD, _train, mode=mode, steps=args.steps, layers=args.layers, dim=args.dim, timeout_s=900)
        curves[mode], seconds[mode] = result[0]["losses"], result[0]["seconds"]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    _write_csv(args.out_dir / "loss_curves.csv", curves)
    (args.out_dir / "loss_curves.svg").write_text(_plot(curves, args.steps))
    ddp = curves["ddp"]
    print(
        f"GPT {args.layers} layers x {args.dim}, {WORLD} gloo ranks, {WORLD * MICRO} windows per step, "
        f"{args.steps} steps, fp32 AdamW lr {LR}, clip {CLIP}; wrote {args.out_dir / 'loss_curves.csv'} and .svg"
    )
    print(f"{'mode':<22}{'first loss':>11}{'last loss':>11}{'max |diff|':>12}{'at step':>8}{'train s':>9}")
    rows = []
    for mode, curve in curves.items():
        diffs = [abs(a - b) for a, b in zip(curve, ddp, strict=True)]
        worst = max(range(len(diffs)), key=diffs.__getitem__)
        print(
            f"{MODES[mode]:<22}{curve[0]:>11.5f}{curve[-1]:>11.5f}{diffs[worst]:>12.2e}{worst + 1:>8}"
            f"{seconds[mode]:>9.1f}"
        )
        if mode == "ddp":
            continue
        rows.append(
            _report.Row(
                "loss_curves",
                f"{MODES[mode]}: max |loss - DDP loss| over {args.steps} steps",
                diffs[worst],
                "",
                MODES["ddp"],
                None,
                target=f"<= {TOLERANCE}",
            )
        )
        rows.append(
            _report.Row(
                "loss_curves", f"{MODES[mode]}: loss at step {args.steps}", curve[-1], "", MODES["ddp"], ddp[-1]
            )
        )
    _report.write_rows(args.json, rows)


if __name__ == "__main__":
    main()
