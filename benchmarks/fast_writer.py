"""Checkpoint save time of a ~0.6B-parameter state: the FastPersist writer vs torch.save, both published atomically.

Both contenders are the engine's own path for one checkpoint file (`ds_engine._checkpoint.file_writer`):
`torch.save` is `ds_comm.atomic_save` (what `save_checkpoint` does without `checkpoint.writer`); `fast` is
`CheckpointFileWriter.save` with `checkpoint.writer: {"type": "fast"}` (double buffer unless --single), the
`aio` section's defaults. Each writes a temporary file, fsyncs it, renames it over the target and fsyncs the
directory, so every second counted ends with the bytes on the device. Saves alternate rep by rep (disk noise
hits both alike); the figure is the median time and the ratio is the median of per-rep ratios.

The state: `--params` parameters (default 0.6e9, the size of benchmarks/infinity.py's 0.6B model) as
transformer-shaped bf16 tensors (1.2 GB; `--dtype float32` doubles it), filled with random values.

    python benchmarks/fast_writer.py [--dir /tmp] [--params 6e8] [--dtype bfloat16] [--reps 3]
                                     [--io-buffer-mib 64] [--single] [--json rows.json]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _report import Row, add_json_argument, write_rows

from ds_comm import atomic_save
from ds_engine._checkpoint.file_writer import CheckpointFileWriter
from ds_engine._plan.dist_info import DistInfo
from ds_engine.config import CheckpointWriterConfig
from ds_ops.aio import AioConfig

GB = 1e9


def make_state(params: int, dtype: torch.dtype, hidden: int = 2048) -> dict[str, torch.Tensor]:
    """Layers of a decoder (attention 4*h*h, MLP 3*h*(3h)) until `params` parameters, then an embedding remainder."""
    g = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {}
    per_layer = 4 * hidden * hidden + 3 * hidden * 3 * hidden
    layers = max(0, (params - 151_936 * hidden) // per_layer)
    shapes = [("embed.weight", (max(1, params - layers * per_layer) // hidden, hidden))]
    for i in range(layers):
        shapes += [(f"layers.{i}.attn.{n}.weight", (hidden, hidden)) for n in ("q", "k", "v", "o")]
        shapes += [(f"layers.{i}.mlp.{n}.weight", (3 * hidden, hidden)) for n in ("gate", "up", "down")]
    for name, shape in shapes:
        state[name] = torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)
    return state


def _save_torch(state: Any, path: Path) -> None:
    atomic_save({"module": state}, path)


def measure(directory: Path, state: dict[str, torch.Tensor], reps: int, writer: CheckpointFileWriter) -> dict:
    times: dict[str, list[float]] = {"torch.save": [], "fast": []}
    sizes: dict[str, int] = {}
    contenders = {
        "torch.save": lambda path: _save_torch(state, path),
        "fast": lambda path: writer.save({"module": state}, path),
    }
    for rep in range(reps + 1):  # rep 0 warms up (op load, buffer allocation, page faults)
        order = list(contenders) if rep % 2 == 0 else list(reversed(contenders))
        for name in order:
            path = directory / f"{name}.pt"
            start = time.perf_counter()
            contenders[name](path)
            elapsed = time.perf_counter() - start
            if rep:
                times[name].append(elapsed)
            sizes[name] = path.stat().st_size
            path.unlink()
    return {"times": times, "sizes": sizes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--params", type=float, default=6e8)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--io-buffer-mib", type=int, default=64)
    parser.add_argument("--single", action="store_true", help="one I/O buffer instead of two halves")
    add_json_argument(parser)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    state = make_state(int(args.params), dtype)
    numel = sum(t.numel() for t in state.values())
    settings = CheckpointWriterConfig(
        type="FAST", io_buffer_size=args.io_buffer_mib << 20, io_buffer_double=not args.single
    )
    writer = CheckpointFileWriter(settings, AioConfig(), DistInfo(), torch.device("cpu"))
    with tempfile.TemporaryDirectory(prefix="ds_fast_writer_bench_", dir=args.dir) as tmp:
        result = measure(Path(tmp), state, args.reps, writer)
    writer.close()
    t_torch, t_fast = result["times"]["torch.save"], result["times"]["fast"]
    ratios = [f / t for f, t in zip(t_fast, t_torch, strict=True)]
    nbytes = result["sizes"]["fast"]
    buffers = f"{'one' if args.single else 'two halves of a'} {args.io_buffer_mib} MiB buffer"
    label = f"{numel / 1e9:.2f}B params {args.dtype} ({nbytes / GB:.2f} GB), {buffers}, dir {args.dir}"
    print(f"torch {torch.__version__}; {label}; {args.reps} reps alternating, after a warm-up save of each")
    print(f"{'contender':<12}{'median s':>10}{'GB/s':>8}   every rep (s)")
    for name, ts in (("torch.save", t_torch), ("fast", t_fast)):
        med = statistics.median(ts)
        print(f"{name:<12}{med:>10.3f}{nbytes / med / GB:>8.2f}   {', '.join(f'{t:.3f}' for t in ts)}")
    print(f"fast / torch.save time: median of per-rep ratios {statistics.median(ratios):.3f}")
    print(f"file sizes: torch.save {result['sizes']['torch.save']} bytes, fast {nbytes} bytes")
    rows = [
        Row(
            benchmark="fast_writer",
            figure=f"checkpoint save through the atomic publish, paired: FastPersist writer ({label})",
            value=statistics.median(t_fast),
            unit="s",
            baseline="torch.save (ds_comm.atomic_save)",
            baseline_value=statistics.median(t_torch),
            ratio=statistics.median(ratios),
        )
    ]
    write_rows(args.json, rows)


if __name__ == "__main__":
    main()
