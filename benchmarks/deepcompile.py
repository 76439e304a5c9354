"""DeepCompile at ZeRO-3 on 2 gloo ranks: step time and memory against ds's eager ZeRO-3.

Run: python benchmarks/deepcompile.py [--steps 6] [--batch 4] [--seq 64] [--modes eager,torch_compile,deepcompile]
Model: the GPT-style decoder of `zero.py` (~21M parameters, 10 layers of width 384), AdamW, fp32, ZeRO stage 3
through `ds_engine.initialize` (every parameter partitioned: `stage3_param_persistence_threshold` 0), one
micro-step per step. Modes, each in its own pair of fresh rank processes:

* eager: ds's ZeRO-3, module hooks gather and release around each module;
* torch_compile: `engine.compile()` without DeepCompile, the module compiled by inductor under the eager hooks;
* deepcompile: `compile.deepcompile: true` + `engine.compile()`, inductor, gathers/releases in the graphs.

The first step of a compiled mode compiles (its time is reported as compile time); after one more warm-up
step the median of `--steps` steps is reported, for the slower rank. Memory: the resident set after the
timed steps (steady state), and the peak, which for the compiled modes includes the compiler's own.
Targets: DeepCompile <= 0.8x eager's step time and no more steady-state memory.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import _report
import torch
import torch.nn.functional as F
from zero import GPT

from ds_comm.testing import run_ranks

MODES = ("eager", "torch_compile", "deepcompile")
TARGETS = {("deepcompile", "wall"): "<= 0.8", ("deepcompile", "rss"): "<= 1"}


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _job(rank: int, world: int, mode: str, steps: int, batch: int, seq: int) -> dict:
    import ds_engine

    torch.manual_seed(0)
    model = GPT()
    config = {
        "train_micro_batch_size_per_gpu": batch,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "compile": {"deepcompile": mode == "deepcompile"},
    }
    engine, *_ = ds_engine.initialize(model=model, config=config)
    if mode != "eager":
        engine.compile(backend="inductor")
    g = torch.Generator().manual_seed(rank)
    idx = torch.randint(0, 8192, (batch, seq + 1), generator=g)

    def step() -> float:
        start = time.perf_counter()
        logits = engine(idx[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        return time.perf_counter() - start

    first = step()
    step()
    times = [step() for _ in range(steps)]
    return {
        "first": first,
        "wall": statistics.median(times),
        "rss": _rss_mib(),
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "active": engine.is_deepcompile_active(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--modes", default=",".join(MODES))
    _report.add_json_argument(parser)
    args = parser.parse_args()
    rows: dict[str, dict] = {}
    for mode in args.modes.split(","):
        per_rank = run_ranks(2, _job, mode, args.steps, args.batch, args.seq, timeout_s=1800)
        rows[mode] = {k: max(r[k] for r in per_rank) for k in ("first", "wall", "rss", "peak_rss")}
        rows[mode]["active"] = all(r["active"] for r in per_rank)
        r = rows[mode]
        print(
            f"{mode:14s} step {r['wall'] * 1e3:8.1f} ms  first step {r['first']:7.1f} s  "
            f"RSS {r['rss']:7.0f} MiB  peak {r['peak_rss']:7.0f} MiB  deepcompile active: {r['active']}",
            flush=True,
        )
    if "eager" in rows:
        for mode in rows:
            if mode != "eager":
                print(
                    f"{mode}/eager: step {rows[mode]['wall'] / rows['eager']['wall']:.3f}x, "
                    f"RSS {rows[mode]['rss'] / rows['eager']['rss']:.3f}x"
                )
    _report.write_rows(args.json, _json_rows(rows, args.steps))


def _json_rows(rows: dict[str, dict], steps: int) -> list[_report.Row]:
    out = []
    if "eager" not in rows:
        return out
    for mode in rows:
        if mode == "eager":
            continue
        for key, label, unit in (
            ("wall", f"step wall time, median of {steps}", "s"),
            ("rss", "steady-state RSS", "MiB"),
            ("peak_rss", "peak RSS (compiler included)", "MiB"),
        ):
            out.append(
                _report.Row(
                    "deepcompile",
                    f"{mode}: {label}",
                    rows[mode][key],
                    unit,
                    "ds eager ZeRO-3",
                    rows["eager"][key],
                    target=TARGETS.get((mode, key), ""),
                )
            )
        out.append(_report.Row("deepcompile", f"{mode}: first step (compiles)", rows[mode]["first"], "s"))
    return out


if __name__ == "__main__":
    main()
