"""One ZeRO-Infinity training job, run by `benchmarks/infinity.py` under ds or under DeepSpeed 0.19.8.

A stack of `--layers` Linear(width, width) layers (36 x 8192 x 8192 = 2.42B parameters by default) built under
`zero.Init(remote_device=...)`, stage 3, bf16, AdamW, one rank, batch `--batch` rows of `width` features.
With `--offload nvme` parameters and optimizer state live in swap files under `--nvme`; with `--offload none`
the same model trains in memory (the reference for the losses). Each step is timed in three phases (forward,
`engine.backward`, `engine.step`); under ds every aio request is traced (`ds_ops.aio.IoTrace`) and the base
optimizer's own step calls are timed, so the report can say how much of each phase was NVMe traffic, how
much was CPU Adam, and how much of the traffic overlapped compute. Peak RSS is per step (the kernel's
high-water mark is reset before each). Writes one JSON object to `--out`.

This file imports only torch and the side's package, so DeepSpeed's own venv can run it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn


class Tower(nn.Module):
    """`layers` x (Linear(width, width) -> tanh); tanh keeps bf16 activations bounded at any depth."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return torch.nn.functional.mse_loss(x.float(), target)


def ds_config(args: argparse.Namespace) -> dict[str, Any]:
    numel = args.width * args.width
    zero: dict[str, Any] = {
        "stage": 3,
        "sub_group_size": args.sub_group,
        "stage3_max_live_parameters": args.live,
        "stage3_prefetch_bucket_size": 2 * numel,
        "stage3_param_persistence_threshold": 2 * args.width,
    }
    if args.offload == "nvme":
        zero["offload_param"] = {
            "device": "nvme",
            "nvme_path": args.nvme,
            "buffer_count": args.buffers,
            "buffer_size": numel,
            "max_in_cpu": 0,
            "pin_memory": False,
        }
        # DeepSpeed 0.19.8's pipelined optimizer swapper stops here with `assert new_alloc_buffers is not None`
        # (4 buffers): its side runs unpipelined, its default
        pipelined = args.side == "ds"
        zero["offload_optimizer"] = {
            "device": "nvme",
            "nvme_path": args.nvme,
            "buffer_count": 4,
            "pipeline_read": pipelined,
            "pipeline_write": pipelined,
            "pin_memory": False,
        }
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        # the users' defaults: DeepSpeed's bf16.check_grad_overflow (on) and gradient_clipping (0; configs often
        # set 1.0: --clip). ds updates sub-groups during backward speculatively either way (ds_zero._nvme.eager_step)
        "gradient_clipping": args.clip,
        "bf16": {"enabled": True, "check_grad_overflow": not args.no_overflow_check},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "zero_optimization": zero,
        "aio": {
            "block_size": 8 << 20,
            "queue_depth": 32,
            "intra_op_parallelism": args.io_threads,
            "single_submit": False,
            "overlap_events": True,
        },
    }


def _reset_peak_rss() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


def _peak_rss_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def _disk_bytes(root: str) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                pass
    return total


class _AdamClock:
    """Sums the wall time of the base optimizer's `step` calls (CPU Adam on one sub-group each) and keeps
    their intervals, via torch's optimizer step hooks."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.intervals: list[tuple[int, int]] = []
        self._start = 0
        optimizer.register_step_pre_hook(self._pre)
        optimizer.register_step_post_hook(self._post)

    def _pre(self, *_: Any) -> None:
        self._start = time.monotonic_ns()

    def _post(self, *_: Any) -> None:
        self.intervals.append((self._start, time.monotonic_ns()))

    def take(self) -> list[tuple[int, int]]:
        taken, self.intervals = self.intervals, []
        return taken


def _base_optimizer(engine: Any) -> torch.optim.Optimizer | None:
    opt = getattr(engine, "optimizer", None)
    for _ in range(3):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            break
        opt = inner
    return opt if isinstance(opt, torch.optim.Optimizer) else None


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.side == "ds":
        import ds_engine as deepspeed
    else:
        import deepspeed  # type: ignore[no-redef]

        # one rank without a launcher: DeepSpeed looks for these before it falls back to MPI discovery
        for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_SIZE", "1")):
            os.environ.setdefault(key, value)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        deepspeed.init_distributed(dist_backend="gloo")
    if args.offload == "nvme":
        shutil.rmtree(args.nvme, ignore_errors=True)
        Path(args.nvme).mkdir(parents=True)
    config = ds_config(args)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    remote = "nvme" if args.offload == "nvme" else "cpu"
    with deepspeed.zero.Init(config_dict_or_path=config, remote_device=remote, dtype=torch.bfloat16):
        model = Tower(args.width, args.layers)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    build_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(1)
    data = [
        (
            torch.randn(args.batch, args.width, generator=gen).to(torch.bfloat16),
            torch.randn(args.batch, args.width, generator=gen).clamp(-0.9, 0.9),
        )
        for _ in range(args.steps)
    ]
    trace = None
    if args.side == "ds":
        from ds_ops.aio import IoTrace

        trace = IoTrace().__enter__()
    base = _base_optimizer(engine)
    adam = _AdamClock(base) if base is not None else None
    steps = []
    for x, target in data:
        _reset_peak_rss()
        if trace is not None:
            trace.take()
        if adam is not None:
            adam.take()
        cpu0 = time.process_time()
        a = time.monotonic_ns()
        loss = engine(x, target)
        b = time.monotonic_ns()
        engine.backward(loss)
        c = time.monotonic_ns()
        engine.step()
        d = time.monotonic_ns()
        cpu_s = time.process_time() - cpu0  # every thread of the process (aio workers included): a loaded host's figure
        step: dict[str, Any] = {
            "loss": float(loss.detach()),
            "t": [a, b, c, d],
            "peak_rss_gib": _peak_rss_gib(),
            "cpu_s": cpu_s,
        }
        if trace is not None:
            step["io"] = [(r.op, r.nbytes, r.start_ns, r.end_ns) for r in trace.take()]
        if adam is not None:
            step["adam"] = adam.take()
        steps.append(step)
        print(
            f"[{args.side}] step {len(steps)}: loss {step['loss']:.6f}  {(d - a) / 1e9:.2f} s "
            f"(fwd {(b - a) / 1e9:.2f}, bwd {(c - b) / 1e9:.2f}, step {(d - c) / 1e9:.2f})  "
            f"peak RSS {step['peak_rss_gib']:.2f} GiB, CPU {cpu_s:.2f} s",
            flush=True,
        )
    return {
        "side": args.side,
        "params": sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters()),
        "layers": args.layers,
        "width": args.width,
        "build_s": build_s,
        "disk_bytes": _disk_bytes(args.nvme) if args.offload == "nvme" else 0,
        "steps": steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", choices=("ds", "deepspeed"), required=True)
    parser.add_argument("--offload", choices=("nvme", "none"), default="nvme")
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--width", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--nvme", default="/tmp/ds_infinity_swap")
    parser.add_argument("--buffers", type=int, default=16, help="offload_param.buffer_count")
    parser.add_argument("--live", type=float, default=2e8, help="stage3_max_live_parameters")
    parser.add_argument("--sub-group", type=int, default=int(1e9), help="sub_group_size")
    parser.add_argument("--io-threads", type=int, default=2, help="aio.intra_op_parallelism")
    parser.add_argument("--clip", type=float, default=0.0, help="gradient_clipping (DeepSpeed's default: 0)")
    parser.add_argument(
        "--no-overflow-check", action="store_true", help="bf16.check_grad_overflow false (default: on, DeepSpeed's)"
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    args.live = int(args.live)
    result = run(args)
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
