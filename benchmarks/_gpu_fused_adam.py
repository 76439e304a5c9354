"""Step time of ds-ops' FusedAdam against `torch.optim.AdamW(fused=True)` on one GPU (a child of benchmarks/gpu.py).

    python benchmarks/_gpu_fused_adam.py --sizes 100000000,300000000,1000000000 [--steps 20] [--cpu]

For each total size, fp32 parameters split into GPT-like tensors (16M elements each, the last one
the rest), random gradients, AdamW (lr 1e-3, weight decay 0.01): a few warm-up steps, then the
median of `--steps` steps timed with CUDA events, each optimizer alone on the device (the other's
memory freed first). The last stdout line is `RESULT <json>`: per size, both medians in ms and
the ratio ours / torch. `--cpu` times torch alone on the CPU (FusedAdam needs CUDA): a smoke run.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

CHUNK = 16 * 2**20


def _params(total: int, device: torch.device) -> list[torch.nn.Parameter]:
    sizes = [CHUNK] * (total // CHUNK) + ([total % CHUNK] if total % CHUNK else [])
    params = []
    for n in sizes:
        p = torch.nn.Parameter(torch.randn(n, device=device) * 0.02)
        p.grad = torch.randn(n, device=device) * 1e-3
        params.append(p)
    return params


def _time_ms(make_optimizer, total: int, device: torch.device, warmup: int, steps: int) -> float:
    params = _params(total, device)
    opt = make_optimizer(params)
    times = []
    for i in range(warmup + steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            opt.step()
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            opt.step()
            elapsed = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(elapsed)
    del opt, params
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100000000,300000000,1000000000")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--cpu", action="store_true")
    args = parser.parse_args()
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    rows = []
    for total in (int(s) for s in args.sizes.split(",")):

        def torch_adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
            return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True)

        row: dict[str, float | int | None] = {
            "params": total,
            "torch_ms": _time_ms(torch_adamw, total, device, args.warmup, args.steps),
        }
        if device.type == "cuda":
            from ds_ops import FusedAdam

            def ours(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
                return FusedAdam(params, lr=1e-3, weight_decay=0.01, adam_w_mode=True)

            row["fused_adam_ms"] = _time_ms(ours, total, device, args.warmup, args.steps)
            row["ratio"] = row["fused_adam_ms"] / row["torch_ms"]
        else:
            row["fused_adam_ms"], row["ratio"] = None, None
        print(
            f"{total / 1e6:.0f}M params: torch fused AdamW {row['torch_ms']:.2f} ms, FusedAdam "
            f"{row['fused_adam_ms'] if row['fused_adam_ms'] is None else round(row['fused_adam_ms'], 2)} ms",
            flush=True,
        )
        rows.append(row)
    print("RESULT " + json.dumps({"mode": "fused_adam", "sizes": rows}), flush=True)


if __name__ == "__main__":
    main()
