"""Step time of ZeRO stage 3 with NVMe offload vs CPU offload vs no offload (used by benchmarks/aio.py --step).

Same model, data, ranks (2 gloo ranks) and base optimizer (torch AdamW, fp32) for every mode. Each rank
process builds all three modes and runs one step of each in rotation (machine noise hits all alike); the
median step of the slower rank is reported. NVMe: parameters and optimizer state in swap files under one
directory (`--dir`, default a temporary directory on this disk), `max_in_cpu` 0, sub-groups of
`--sub-group` elements, pipelined reads and writes. CPU: both offloaded to host memory.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any

import torch
from torch import nn

import ds_zero
from ds_comm.testing import run_ranks

MODES = ("none", "cpu", "nvme")


class Tower(nn.Module):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _config(mode: str, root: str, width: int, sub_group: int) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "stage": 3,
        "sub_group_size": sub_group,
        "stage3_prefetch_bucket_size": 2 * width * width,
        "stage3_max_live_parameters": 4 * width * width,
        "stage3_max_reuse_distance": 0,
    }
    if mode == "cpu":
        cfg["offload_param"] = {"device": "cpu"}
        cfg["offload_optimizer"] = {"device": "cpu"}
    elif mode == "nvme":
        cfg["offload_param"] = {
            "device": "nvme",
            "nvme_path": root,
            "max_in_cpu": 0,
            "buffer_count": 6,
            "buffer_size": width * width,
        }
        cfg["offload_optimizer"] = {"device": "nvme", "nvme_path": root, "pipeline_read": True, "pipeline_write": True}
    return cfg


def _rank(
    rank: int,
    world: int,
    *,
    width: int,
    layers: int,
    steps: int,
    batch: int,
    root: str,
    sub_group: int,
    aio: dict[str, Any],
) -> dict[str, Any]:
    runs = {}
    for mode in MODES:
        torch.manual_seed(0)
        model = Tower(width, layers)
        base = torch.optim.AdamW(model.parameters(), lr=1e-4)
        opt = ds_zero.DeepSpeedZeroOptimizer_Stage3(
            model, base, config=_config(mode, root, width, sub_group), aio_config=aio
        )
        runs[mode] = (model, opt)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    losses: dict[str, list[float]] = {m: [] for m in MODES}
    for step in range(steps + 1):  # step 0 warms up (first-step state allocation, trace recording)
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(batch, width, generator=g)
        for mode, (model, opt) in runs.items():
            start = time.perf_counter()
            loss = model(x).pow(2).mean()
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            if step:
                times[mode].append(time.perf_counter() - start)
            losses[mode].append(loss.item())
    nvme = runs["nvme"][1]
    return {
        "median_s": {m: statistics.median(t) for m, t in times.items()},
        "losses": losses,
        "nvme_reads": nvme.parameter_offload.param_swapper.num_reads + nvme.optimizer_swapper.num_reads,
    }


def step_rows(
    *,
    width: int = 1024,
    layers: int = 8,
    steps: int = 6,
    batch: int = 16,
    directory: str | None = None,
    sub_group: int = 1_000_000,
    aio: dict[str, Any] | None = None,
) -> tuple[list[dict[str, Any]], str]:
    """Rows in benchmarks/aio.py's `--json` format (step time of each offload mode vs no offload) and a table."""
    with tempfile.TemporaryDirectory(dir=directory, prefix="ds_nvme_bench_") as root:
        out = run_ranks(
            2,
            _rank,
            width=width,
            layers=layers,
            steps=steps,
            batch=batch,
            root=root,
            sub_group=sub_group,
            aio=aio or {},
            timeout_s=900,
        )
    for m in MODES[1:]:  # the three modes train the same model on the same data
        diff = max(abs(a - b) for a, b in zip(out[0]["losses"][m], out[0]["losses"]["none"], strict=True))
        assert diff < 1e-5, f"mode {m} diverged from no offload by {diff}"
    numel = width * width * layers + width * layers
    label = (
        f"stage 3, {numel / 1e6:.1f}M params fp32 AdamW, 2 gloo ranks, batch {batch}, sub_group_size {sub_group}, "
        f"dir {directory or tempfile.gettempdir()}"
    )
    step_ms = {m: 1e3 * max(r["median_s"][m] for r in out) for m in MODES}
    titles = {
        "none": "no offload",
        "cpu": "CPU offload (params + optimizer)",
        "nvme": "NVMe offload (params + optimizer)",
    }
    header = f"{'mode':<36} {'step ms':>9} {'vs none':>8} {'vs cpu':>7}"
    lines = [header, "-" * len(header)]
    rows = []
    for mode in MODES:
        lines.append(
            f"{titles[mode]:<36} {step_ms[mode]:>9.1f} {step_ms[mode] / step_ms['none']:>8.2f} "
            f"{step_ms[mode] / step_ms['cpu']:>7.2f}"
        )
        if mode != "none":
            base = "cpu" if mode == "nvme" else "none"
            rows.append(
                {
                    "figure": f"zero3 step time: {titles[mode]} ({label})",
                    "value": round(step_ms[mode], 2),
                    "unit": "ms",
                    "baseline": titles[base],
                    "baseline_value": round(step_ms[base], 2),
                    "ratio": round(step_ms[mode] / step_ms[base], 3),
                    "target": None,
                }
            )
    lines.append(
        f"optimizer state (fp32 master + Adam) per rank: {numel * 12 / 2 / 2**20:.0f} MiB; "
        f"NVMe swap-ins per rank over the run: {out[0]['nvme_reads']}"
    )
    return rows, "\n".join(lines)
