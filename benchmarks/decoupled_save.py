"""How long a checkpoint save blocks training: `checkpoint.writer.decoupled` vs the synchronous save.

One engine (a ~100M-parameter stack of linear layers, fp32, AdamW: ~1.2 GB of model states and optimizer
state, in one model-states file) saves with `checkpoint.writer: {"type": "fast"}` both ways, alternating rep by
rep; every file goes through the same atomic publish (temporary name, fsync, rename), so a save is done when
its bytes are on the device. Per rep:

* synchronous: the wall time of `save_checkpoint` (training is blocked all of it) and the training thread's
  CPU time in it;
* decoupled: the wall time of `save_checkpoint` (the snapshot; then training goes on), the training
  thread's CPU time in it, the time of the training step that runs while the worker writes (next to a plain
  step's), and the time from the save until `commit_checkpoint` has every file durable and `latest` moved.

The blocked-time ratio is the median of per-rep ratios (decoupled / synchronous). Wall times on a loaded
host are noisy; the CPU figures are the training thread's own (`time.thread_time`).

    python benchmarks/decoupled_save.py [--dir /tmp] [--layers 24] [--hidden 2048] [--reps 3] [--json rows.json]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _report import Row, add_json_argument, write_rows
from torch import nn

import ds_engine

GB = 1e9


def _engine(layers: int, hidden: int, io_buffer_mib: int) -> Any:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(hidden, hidden) for _ in range(layers)))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "checkpoint": {
            "layout": "ds",
            "writer": {"type": "fast", "io_buffer_size": io_buffer_mib << 20, "decoupled": True},
        },
    }
    engine, *_ = ds_engine.initialize(model=model, config=config, dist_init_required=False)
    return engine


def _step(engine: Any, hidden: int) -> float:
    x = torch.randn(4, hidden)
    t0 = time.perf_counter()
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    return time.perf_counter() - t0


def _timed(fn: Any) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - wall, time.thread_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--io-buffer-mib", type=int, default=64)
    add_json_argument(parser)
    args = parser.parse_args()
    engine = _engine(args.layers, args.hidden, args.io_buffer_mib)
    params = sum(p.numel() for p in engine.module.parameters())
    decoupled = engine._checkpointer.decoupled
    _step(engine, args.hidden)  # optimizer state exists from here on
    rows: dict[str, list[float]] = {k: [] for k in ("sync", "sync_cpu", "dec", "dec_cpu", "step_bg", "step", "durable")}
    nbytes = 0
    with tempfile.TemporaryDirectory(prefix="ds_decoupled_bench_", dir=args.dir) as tmp:
        root = Path(tmp)
        for rep in range(args.reps + 1):  # rep 0 warms both paths up
            rows_now: dict[str, float] = {}
            engine._checkpointer.decoupled = None
            rows_now["sync"], rows_now["sync_cpu"] = _timed(lambda r=rep: engine.save_checkpoint(str(root), f"s{r}"))
            nbytes = sum(f.stat().st_size for f in (root / f"s{rep}").iterdir())
            shutil.rmtree(root / f"s{rep}")
            rows_now["step"] = _step(engine, args.hidden)
            engine._checkpointer.decoupled = decoupled
            start = time.perf_counter()
            rows_now["dec"], rows_now["dec_cpu"] = _timed(lambda r=rep: engine.save_checkpoint(str(root), f"d{r}"))
            rows_now["step_bg"] = _step(engine, args.hidden)
            engine.commit_checkpoint()
            rows_now["durable"] = time.perf_counter() - start
            shutil.rmtree(root / f"d{rep}")
            if rep:
                for key, value in rows_now.items():
                    rows[key].append(value)
    engine.destroy()
    med = {k: statistics.median(v) for k, v in rows.items()}
    ratio = statistics.median(d / s for d, s in zip(rows["dec"], rows["sync"], strict=True))
    label = f"{params / 1e6:.0f}M params fp32 + AdamW ({nbytes / GB:.2f} GB), FAST writer, dir {args.dir}"
    print(f"torch {torch.__version__}; {label}; {args.reps} reps alternating after a warm-up rep")
    print(f"{'figure':<52}{'median':>9}   every rep")
    for key, what in (
        ("sync", "synchronous save: training blocked (wall s)"),
        ("sync_cpu", "synchronous save: training thread CPU (s)"),
        ("dec", "decoupled save: training blocked (wall s)"),
        ("dec_cpu", "decoupled save: training thread CPU (s)"),
        ("step", "training step, no save in flight (s)"),
        ("step_bg", "training step while the worker writes (s)"),
        ("durable", "decoupled: save -> every file durable + latest (s)"),
    ):
        print(f"{what:<52}{med[key]:>9.3f}   {', '.join(f'{v:.3f}' for v in rows[key])}")
    print(f"decoupled / synchronous blocked time: median of per-rep ratios {ratio:.3f}")
    write_rows(
        args.json,
        [
            Row(
                benchmark="decoupled_save",
                figure=f"time training is blocked by save_checkpoint: decoupled ({label})",
                value=med["dec"],
                unit="s",
                baseline="synchronous save",
                baseline_value=med["sync"],
                ratio=ratio,
            ),
            Row(
                benchmark="decoupled_save",
                figure=f"training step while the decoupled writer writes ({label})",
                value=med["step_bg"],
                unit="s",
                baseline="training step, no save in flight",
                baseline_value=med["step"],
            ),
        ],
    )


if __name__ == "__main__":
    main()
