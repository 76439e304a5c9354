"""ZeRO stages on 2 gloo ranks vs torch DDP: step time (wall and process CPU) and per-rank peak RSS.

Run: python benchmarks/zero.py [--steps 10] [--batch 4] [--seq 64] [--modes ddp,stage2]
Model: a GPT-style decoder (~21M parameters: vocab 8192, 10 layers of width 384, tied embeddings),
AdamW, fp32, one micro-step per step. Step times come from one pair of rank processes holding every
mode, which run one step each in rotation (machine noise hits all alike; these machines are shared);
the median step is reported, for the slower rank. CPU time is process time (all threads, gloo's
included) per step, next to wall time. Peak RSS comes from fresh rank processes per mode.

Modes: torch DDP (bucket_cap_mb=25); stage 0 (ds-engine's when installed, else a stand-in: one
flat all-reduce of the gradients + AdamW, said so in the output); ZeRO stage 1; stage 2
(overlap_comm); stage 2 + CPU optimizer offload (ds_ops.DeepSpeedCPUAdam when available, else
torch AdamW on the host buffers, said so). ZeRO buckets match DDP's 25 MB.
Targets: stage 2 <= 1.02x DDP CPU time per step, peak RSS <= DDP's.
Stage 3 (`--modes fsdp2,stage3`, see benchmarks/_zero3_modes.py) is compared with torch FSDP2
(`fully_shard` per block): targets <= 1.1x FSDP2's step time and no more peak RSS.
"""

from __future__ import annotations

import argparse
import importlib.util
import resource
import statistics
import time

import _report
import torch
import torch.nn as nn
import torch.nn.functional as F
from _gpt import GPT

import ds_comm
import ds_zero
from ds_comm.testing import run_ranks

BUCKET_NUMEL = 25 * 2**20 // 4  # DDP's bucket_cap_mb=25, in fp32 elements
MODES = ("ddp", "stage0", "stage1", "stage2", "stage2+offload", "fsdp2", "stage3")
TARGETS = {
    ("stage2", "cpu"): "<= 1.02",
    ("stage2", "peak_rss"): "<= 1",
    ("stage3", "wall"): "<= 1.1",
    ("stage3", "peak_rss"): "<= 1",
}


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _setup(mode: str, model: GPT) -> tuple[object, object, str]:
    """(module to call, step function after backward, note) for a mode."""
    adamw = dict(lr=3e-4, weight_decay=0.01, foreach=True)
    if mode in ("fsdp2", "stage3"):
        import _zero3_modes

        return _zero3_modes.setup_fsdp2(model) if mode == "fsdp2" else _zero3_modes.setup_stage3(model)
    if mode == "ddp":
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
        opt = torch.optim.AdamW(model.parameters(), **adamw)
        return ddp, (lambda loss: (loss.backward(), opt.step(), opt.zero_grad())), ""
    if mode == "stage0":
        ds_engine = _engine_with_initialize()
        if ds_engine is not None:
            engine, _, _, _ = ds_engine.initialize(
                model=model,
                model_parameters=model.parameters(),
                config={
                    "train_micro_batch_size_per_gpu": 1,
                    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.01, "torch_adam": True}},
                    "zero_optimization": {"stage": 0},
                },
            )
            return engine, (lambda loss: (engine.backward(loss), engine.step())), "ds-engine stage 0"
        return _stage0_standin(model, adamw)
    stage = 1 if mode == "stage1" else 2
    offload = mode.endswith("offload")
    config = ds_zero.ZeroConfig(
        stage=stage,
        overlap_comm=stage == 2,
        reduce_bucket_size=BUCKET_NUMEL,
        allgather_bucket_size=BUCKET_NUMEL,
        offload_optimizer={"device": "cpu" if offload else "none"},
    )
    note = ""
    base: torch.optim.Optimizer
    if offload:
        import ds_ops

        if hasattr(ds_ops, "DeepSpeedCPUAdam"):
            base = ds_ops.DeepSpeedCPUAdam(model.parameters(), lr=3e-4, weight_decay=0.01, adamw_mode=True)
            note = "DeepSpeedCPUAdam"
        else:
            base = torch.optim.AdamW(model.parameters(), **adamw)
            note = "torch AdamW on host buffers (ds_ops.DeepSpeedCPUAdam not installed)"
    else:
        base = torch.optim.AdamW(model.parameters(), **adamw)
    opt = ds_zero.ZeroOptimizer(base, config=config, module=model)
    return model, (lambda loss: (opt.backward(loss), opt.step(), opt.zero_grad())), note


def _engine_with_initialize():  # noqa: ANN202 - a module or None
    """ds_engine when it is installed and provides `initialize`; None otherwise."""
    if importlib.util.find_spec("ds_engine") is None:
        return None
    import ds_engine

    return ds_engine if hasattr(ds_engine, "initialize") else None


def _stage0_standin(model: GPT, adamw: dict) -> tuple[object, object, str]:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, **adamw)
    world = ds_comm.get_world_size()

    def step(loss: torch.Tensor) -> None:
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        ds_comm.all_reduce(flat)
        flat /= world
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        opt.step()
        opt.zero_grad()

    return model, step, "stand-in: flat all-reduce + AdamW (ds-engine.initialize not available)"


def _build(mode: str, batch: int, seq: int, rank: int, steps: int):  # noqa: ANN202 - (run one step, numel, note)
    torch.manual_seed(0)
    model = GPT()
    numel = sum(p.numel() for p in model.parameters())
    module, step, note = _setup(mode, model)
    gen = torch.Generator().manual_seed(rank)
    data = [torch.randint(0, 8192, (batch, seq + 1), generator=gen) for _ in range(steps)]

    def one(i: int) -> None:
        idx = data[i % len(data)]
        logits = module(idx[:, :-1])
        step(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1)))

    return one, numel, note


def _time_interleaved(rank: int, world: int, modes: list[str], steps: int, batch: int, seq: int) -> dict:
    """Every mode in the same processes, one step each in rotation, so machine noise hits all alike."""
    runners = {mode: _build(mode, batch, seq, rank, steps) for mode in modes}
    times: dict[str, dict[str, list[float]]] = {m: {"wall": [], "cpu": []} for m in modes}
    for i in range(steps + 2):
        for mode in modes:
            ds_comm.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            runners[mode][0](i)
            ds_comm.barrier()
            if i >= 2:  # two warm-up steps: buffers, optimizer state
                times[mode]["wall"].append(time.perf_counter() - wall)
                times[mode]["cpu"].append(time.process_time() - cpu)
    return {
        m: {
            "wall": statistics.median(t["wall"]),
            "cpu": statistics.median(t["cpu"]),
            "numel": runners[m][1],
            "note": runners[m][2],
        }
        for m, t in times.items()
    }


def _peak_rss(rank: int, world: int, mode: str, batch: int, seq: int) -> dict:
    """Peak RSS of fresh rank processes running one mode for a few steps (a process holds one model)."""
    start = _rss_mib()
    one, _, _ = _build(mode, batch, seq, rank, 3)
    for i in range(3):
        one(i)
    return {"peak_rss": _peak_rss_mib(), "rss_growth": _peak_rss_mib() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--modes", default=",".join(MODES))
    _report.add_json_argument(parser)
    args = parser.parse_args()
    modes = args.modes.split(",")
    ranks = run_ranks(
        2, _time_interleaved, modes=modes, steps=args.steps, batch=args.batch, seq=args.seq, timeout_s=3600
    )
    rows = {
        m: {k: max(r[m][k] for r in ranks) if k in ("wall", "cpu") else ranks[0][m][k] for k in ranks[0][m]}
        for m in modes
    }
    for mode in modes:
        mem = run_ranks(2, _peak_rss, mode=mode, batch=args.batch, seq=args.seq, timeout_s=1800)
        rows[mode].update(peak_rss=max(r["peak_rss"] for r in mem), rss_growth=max(r["rss_growth"] for r in mem))
    numel = rows[modes[0]]["numel"]
    print(
        f"GPT {numel / 1e6:.1f}M params, fp32 AdamW, 2 gloo ranks x 1 thread, batch {args.batch}x{args.seq} "
        f"tokens/rank; median of {args.steps} steps, modes interleaved step by step (worst rank); peak RSS "
        "from separate 3-step runs per mode"
    )
    ref = rows.get("ddp")
    print(
        f"{'mode':<16}{'wall s/step':>12}{'cpu s/step':>12}{'peak RSS MiB':>14}{'RSS growth':>12}"
        f"{'wall/DDP':>10}{'cpu/DDP':>9}{'RSS/DDP':>9}"
    )
    for mode in modes:
        r = rows[mode]
        ratios = (
            ("", "", "")
            if ref is None
            else (
                f"{r['wall'] / ref['wall']:.3f}",
                f"{r['cpu'] / ref['cpu']:.3f}",
                f"{r['peak_rss'] / ref['peak_rss']:.3f}",
            )
        )
        print(
            f"{mode:<16}{r['wall']:>12.3f}{r['cpu']:>12.3f}{r['peak_rss']:>14.0f}{r['rss_growth']:>12.0f}"
            f"{ratios[0]:>10}{ratios[1]:>9}{ratios[2]:>9}"
        )
    for mode in modes:
        if rows[mode]["note"]:
            print(f"  {mode}: {rows[mode]['note']}")
    if ref is not None and "stage2" in rows:
        cpu_ratio = rows["stage2"]["cpu"] / ref["cpu"]
        rss_ratio = rows["stage2"]["peak_rss"] / ref["peak_rss"]
        print(
            f"targets: stage 2 cpu/DDP {cpu_ratio:.3f} (<= 1.02: {'met' if cpu_ratio <= 1.02 else 'NOT met'}), "
            f"peak RSS/DDP {rss_ratio:.3f} (<= 1: {'met' if rss_ratio <= 1.0 else 'NOT met'})"
        )
    if "fsdp2" in rows and "stage3" in rows:
        fsdp, z3 = rows["fsdp2"], rows["stage3"]
        wall, rss = z3["wall"] / fsdp["wall"], z3["peak_rss"] / fsdp["peak_rss"]
        print(
            f"stage 3 vs FSDP2: wall {wall:.3f}, cpu {z3['cpu'] / fsdp['cpu']:.3f} "
            f"(<= 1.1: {'met' if wall <= 1.1 else 'NOT met'}), peak RSS {rss:.3f} "
            f"(<= 1: {'met' if rss <= 1.0 else 'NOT met'})"
        )
    _report.write_rows(args.json, _json_rows(rows, args.steps))


def _json_rows(rows: dict[str, dict], steps: int) -> list[_report.Row]:
    """Each ZeRO mode's step wall/CPU time and peak RSS against DDP; stage 3 against FSDP2."""
    out = []
    for mode in rows:
        base = "fsdp2" if mode == "stage3" else "ddp"
        if mode in ("ddp", "fsdp2") or base not in rows:
            continue
        for key, label, unit in (
            ("wall", f"step wall time, median of {steps}", "s"),
            ("cpu", f"step CPU time, median of {steps}", "s"),
            ("peak_rss", "peak RSS", "MiB"),
        ):
            out.append(
                _report.Row(
                    "zero",
                    f"{mode}: {label}",
                    rows[mode][key],
                    unit,
                    "torch FSDP2" if base == "fsdp2" else "torch DDP",
                    rows[base][key],
                    target=TARGETS.get((mode, key), ""),
                )
            )
    return out


if __name__ == "__main__":
    main()
