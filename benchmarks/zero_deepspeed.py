"""ZeRO 1/2/3 through `deepspeed.initialize`: ds vs DeepSpeed 0.19.8, CPU time per step on 2 gloo ranks.

Run: python benchmarks/zero_deepspeed.py [--stages 1,2,3] [--steps 10] [--rounds 5]
         [--deepspeed-python /work/dsref/bin/python] [--ds-before CHECKOUT] [--json PATH]

The same program runs on both sides: `import deepspeed` is ds's compatibility package under this
interpreter and the pinned release under `--deepspeed-python` (its venv: torch 2.13 CPU and
deepspeed==0.19.8, run with DS_ACCELERATOR=cpu and no PYTHONPATH). Each run is a fresh pair of rank
processes (gloo, 1 thread each) building the GPT of benchmarks/_gpt.py (~21M parameters, tied
embeddings), a client torch AdamW (foreach) and `deepspeed.initialize` with one config per stage
(ZeRO-3 as in benchmarks/_zero3_modes.py: buckets of one block, persistence threshold 100k). A step
is forward, `engine.backward`, `engine.step`. Runs alternate side by side (ds, DeepSpeed, ds, ...)
for `--rounds` rounds so machine noise hits both alike, each round starting with the next side; a run's
figure is the median over its `--steps` steps (after 3 warm-up steps) of the process CPU time (all
threads) summed over the two ranks, and a side's figure is the median over rounds. The ratio to DeepSpeed
is paired: each round's ds run against the same round's DeepSpeed run, the median of those per-round
ratios (a 3-round ratio of medians moved by about 0.1 between runs of the same code here, one slow run of
either side shifting it). Peak RSS is the larger rank's `ru_maxrss`.
Targets: ZeRO-3 <= 0.8x DeepSpeed's CPU time per step, ZeRO-1/2 <= 0.75x, peak RSS <= 1x.

`--sides ds,deepspeed,floor` adds the floor of any ZeRO-1/2 on this host: the same ranks and steps in plain
PyTorch without a single collective: forward, backward, each gradient copied into one flat fp32 buffer (as
ZeRO copies it into its buckets), and the client AdamW stepping this rank's half of that flat buffer (the
partition a ZeRO-1/2 rank owns). Whatever a ZeRO-1/2 implementation adds (reduce-scatter, all-gather, hooks)
comes on top of it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import _report

HERE = Path(__file__).resolve().parent
TARGETS = {1: 0.75, 2: 0.75, 3: 0.8}


def _config(stage: int, block: int, embed: int) -> dict:
    zero: dict = {"stage": stage, "reduce_bucket_size": 25 * 2**20 // 4, "allgather_bucket_size": 25 * 2**20 // 4}
    if stage == 2:
        zero["overlap_comm"] = True
    if stage == 3:
        zero = {
            "stage": 3,
            "reduce_bucket_size": block,
            "sub_group_size": block,
            "stage3_prefetch_bucket_size": block,
            "stage3_max_live_parameters": 2 * block + embed,
            "stage3_max_reuse_distance": block,
            "stage3_param_persistence_threshold": 100_000,
        }
    return {"train_micro_batch_size_per_gpu": 4, "zero_optimization": zero, "steps_per_print": 10**9}


def _rank(rank: int, port: int, stage: int, steps: int, batch: int, seq: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    sys.path.insert(0, str(HERE))
    from _gpt import GPT

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = GPT()
    if os.environ.get("ZERO_DS_FLOOR"):
        deepspeed: Any = SimpleNamespace(__version__="floor (plain PyTorch)", __file__="-")
        engine = _Floor(model, rank)
    else:
        import deepspeed

        block = sum(p.numel() for p in model.blocks[0].parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01, foreach=True)
        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=opt, config=_config(stage, block, model.wte.weight.numel())
        )
    gen = torch.Generator().manual_seed(rank)
    data = [torch.randint(0, 8192, (batch, seq + 1), generator=gen) for _ in range(4)]
    cpu, wall, main, losses, faults = [], [], [], [], []
    prof = None
    if os.environ.get("ZERO_DS_PROFILE") and rank == 0:  # a cProfile of rank 0's timed steps, for looking into
        import cProfile

        # the main thread's CPU time (ZERO_DS_PROFILE_WALL=1: wall time, waits included)
        prof = cProfile.Profile() if os.environ.get("ZERO_DS_PROFILE_WALL") else cProfile.Profile(time.thread_time)
    for i in range(steps + 3):
        if prof is not None and i == 3:
            prof.enable()
        idx = data[i % len(data)]
        dist.barrier()
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
        logits = engine(idx[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        m1, c1, t1 = time.thread_time(), time.process_time(), time.perf_counter()
        f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        losses.append(loss.item())
        if i >= 3:
            faults.append(f1 - f0)
            cpu.append(c1 - c0)
            wall.append(t1 - t0)
            main.append(m1 - m0)
    if prof is not None:
        prof.disable()
        prof.dump_stats(os.environ["ZERO_DS_PROFILE"])
    result = {
        "cpu": cpu,
        "wall": wall,
        "main": main,
        "faults": faults,
        "losses": losses,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "deepspeed": getattr(deepspeed, "__version__", "?"),
        "module": deepspeed.__file__,
    }
    Path(f"{out}.{rank}").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


class _Floor:
    """The `floor` side's engine: what a ZeRO-1/2 rank cannot avoid, without communication (module docstring)."""

    def __init__(self, model: Any, rank: int) -> None:
        import torch

        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        numel = sum(p.numel() for p in self.params)
        self.flat_grad = torch.zeros(numel)
        half = numel // 2
        self.lo, self.hi = (0, half) if rank == 0 else (half, numel)
        self.master = torch.cat([p.detach().reshape(-1) for p in self.params])[self.lo : self.hi].clone()
        self.master.requires_grad_(True)
        self.opt = torch.optim.AdamW([self.master], lr=3e-4, weight_decay=0.01, foreach=True)

    def __call__(self, idx: Any) -> Any:
        return self.model(idx)

    def backward(self, loss: Any) -> None:
        loss.backward()

    def step(self) -> None:
        at = 0
        for p in self.params:
            n = p.numel()
            self.flat_grad[at : at + n].copy_(p.grad.reshape(-1))
            p.grad = None
            at += n
        self.master.grad = self.flat_grad[self.lo : self.hi]
        self.opt.step()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_side(python: str, env: dict, stage: int, steps: int, batch: int, seq: int, tmp: Path) -> dict:
    """One run: two rank processes of this script under `python`; per-step CPU summed over ranks.

    A run whose rank process dies of a signal is run again (twice at most, said on stdout): DeepSpeed
    0.19.8's CPU ranks now and then abort with "terminate called without an active exception"."""
    args = ["--stage", str(stage), "--steps", str(steps), "--batch", str(batch), "--seq", str(seq)]
    for attempt in range(3):
        port = _free_port()
        out = str(tmp / f"r{time.monotonic_ns()}")
        procs = [
            subprocess.Popen([python, __file__, "--rank", str(r), "--port", str(port), "--out", out, *args], env=env)
            for r in range(2)
        ]
        codes = [p.wait(timeout=1800) for p in procs]
        if all(code == 0 for code in codes):
            break
        if attempt == 2 or not any(code < 0 for code in codes):
            raise SystemExit(f"{python} stage {stage} rank failed (exit codes {codes})")
        print(f"  {python} stage {stage}: a rank died (exit codes {codes}); running it again", flush=True)
    ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    per_step = [a + b for a, b in zip(ranks[0]["cpu"], ranks[1]["cpu"], strict=True)]
    return {
        "cpu": statistics.median(per_step),
        "wall": statistics.median(max(a, b) for a, b in zip(ranks[0]["wall"], ranks[1]["wall"], strict=True)),
        "main": statistics.median(a + b for a, b in zip(ranks[0]["main"], ranks[1]["main"], strict=True)),
        "faults": statistics.median(a + b for a, b in zip(ranks[0]["faults"], ranks[1]["faults"], strict=True)),
        "peak_rss": max(r["peak_rss"] for r in ranks),
        "losses": ranks[0]["losses"],
        "version": ranks[0]["deepspeed"],
        "module": ranks[0]["module"],
    }


def _src_path(root: Path) -> str:
    return os.pathsep.join(str(p) for p in sorted((root / "packages").glob("*/src")))


def _envs(deepspeed_python: str, before: str) -> dict[str, tuple[str, dict]]:
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")}
    # DeepSpeed 0.19.8 calls torch's deprecated collective names, which print a FutureWarning per call
    # under torch 2.13: silenced on both sides so that neither pays for printing them.
    base.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore::FutureWarning")
    ds_env = dict(base)
    ds_env["PYTHONPATH"] = _src_path(HERE.parent)
    ref_env = {k: v for k, v in base.items() if k != "PYTHONPATH"}
    sides = {"ds": (sys.executable, ds_env)}
    if before:  # another checkout of ds (e.g. the commit before a change), run the same way
        sides["ds-before"] = (sys.executable, {**ds_env, "PYTHONPATH": _src_path(Path(before))})
    if deepspeed_python and Path(deepspeed_python).exists():
        sides["deepspeed"] = (deepspeed_python, ref_env)
    sides["floor"] = (sys.executable, {**ds_env, "ZERO_DS_FLOOR": "1"})
    return sides


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", default="1,2,3")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--sides", default="ds,deepspeed")
    parser.add_argument("--deepspeed-python", default="/work/dsref/bin/python")
    parser.add_argument("--ds-before", default="", help="a ds checkout to run as a third side, 'ds-before'")
    parser.add_argument("--json", default="")
    parser.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--stage", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank >= 0:
        _rank(args.rank, args.port, args.stage, args.steps, args.batch, args.seq, args.out)
        return
    import tempfile

    wanted = args.sides.split(",") + (["ds-before"] if args.ds_before else [])
    sides = {k: v for k, v in _envs(args.deepspeed_python, args.ds_before).items() if k in wanted}
    if "deepspeed" in args.sides.split(",") and "deepspeed" not in sides:
        print(f"no DeepSpeed interpreter at {args.deepspeed_python}: ds side only")
    stages = [int(s) for s in args.stages.split(",")]
    runs: dict[tuple[str, int], list[dict]] = {(s, z): [] for s in sides for z in stages}
    with tempfile.TemporaryDirectory() as tmp:
        order = list(sides.items())
        for round_index in range(args.rounds):
            # each round starts with the next side, so no side always runs first after a stage change
            shift = round_index % len(order)
            for stage in stages:
                for side, (python, env) in order[shift:] + order[:shift]:
                    r = _run_side(python, env, stage, args.steps, args.batch, args.seq, Path(tmp))
                    runs[(side, stage)].append(r)
                    print(
                        f"  {side:<9} stage {stage}: cpu {r['cpu']:.3f} s/step (2 ranks; main threads "
                        f"{r['main']:.3f}), wall {r['wall']:.3f} s, {r['faults']:.0f} page faults/step",
                        flush=True,
                    )
    print(
        f"GPT ~21M, fp32 torch AdamW, 2 gloo ranks x 1 thread, batch {args.batch}x{args.seq}; {args.rounds} rounds "
        f"alternating sides, each the median of {args.steps} steps; CPU = process time summed over ranks"
    )
    print(f"{'stage':<7}{'side':<11}{'cpu s/step':>11}{'wall s':>8}{'peak RSS':>10}{'cpu/DS':>8}{'RSS/DS':>8}  target")
    print("        (cpu/DS: the median of the per-round ratios, each round's run against its DeepSpeed run)")
    rows = []
    for stage in stages:
        ref = runs.get(("deepspeed", stage))
        ref_cpu = statistics.median(r["cpu"] for r in ref) if ref else None
        ref_rss = max(r["peak_rss"] for r in ref) if ref else None
        for side in sides:
            rs = runs[(side, stage)]
            cpu = statistics.median(r["cpu"] for r in rs)
            wall = statistics.median(r["wall"] for r in rs)
            rss = max(r["peak_rss"] for r in rs)
            ratio = f"{_report.paired_ratio([r['cpu'] for r in rs], [r['cpu'] for r in ref]):.3f}" if ref else ""
            rss_ratio = f"{rss / ref_rss:.3f}" if ref_rss else ""
            tgt = f"<= {TARGETS[stage]}" if side == "ds" and ref_cpu else ""
            print(f"{stage:<7}{side:<11}{cpu:>11.3f}{wall:>8.3f}{rss:>10.0f}{ratio:>8}{rss_ratio:>8}  {tgt}")
            rows.append(dict(stage=stage, side=side, cpu=cpu, wall=wall, peak_rss=rss, runs=[r["cpu"] for r in rs]))
            if ref and side != "deepspeed":
                each = ", ".join(f"{a['cpu'] / b['cpu']:.3f}" for a, b in zip(rs, ref, strict=True))
                print(f"{'':18}per round: {each}")
        if ref and ("ds", stage) in runs:
            diff = max(abs(a - b) for a, b in zip(runs[("ds", stage)][0]["losses"], ref[0]["losses"], strict=True))
            print(f"        stage {stage} max |loss ds - loss DeepSpeed| over the run: {diff:.2e}")
    _report.write_rows(args.json, report_rows(rows, args.rounds))


def report_rows(results: list[dict], rounds: int) -> list[_report.Row]:
    """RESULTS.md's rows from the per-(stage, side) results: ds's CPU time per step, wall time and peak RSS
    against DeepSpeed's (ds alone when DeepSpeed did not run)."""
    by = {(r["side"], r["stage"]): r for r in results}
    rows = []
    for (side, stage), r in sorted(by.items(), key=lambda item: item[0][1]):
        if side != "ds":
            continue
        ref = by.get(("deepspeed", stage))
        base = "DeepSpeed 0.19.8 (same run)" if ref else ""
        what = f"stage {stage}, 21M GPT, 2 ranks"
        rows += [
            _report.Row(
                "zero_deepspeed",
                f"{what}: CPU time per step (both ranks), paired median of {rounds} rounds",
                r["cpu"],
                "s",
                base,
                ref["cpu"] if ref else None,
                ratio=_report.paired_ratio(r["runs"], ref["runs"]) if ref else None,
                target=f"<= {TARGETS[stage]}" if ref else "",
            ),
            _report.Row(
                "zero_deepspeed", f"{what}: wall time per step", r["wall"], "s", base, ref["wall"] if ref else None
            ),
            _report.Row(
                "zero_deepspeed",
                f"{what}: peak RSS (larger rank)",
                r["peak_rss"],
                "MiB",
                base,
                ref["peak_rss"] if ref else None,
                target="<= 1" if ref else "",
            ),
        ]
        floor = by.get(("floor", stage))
        if floor is not None and stage in (1, 2):
            rows.append(
                _report.Row(
                    "zero_deepspeed",
                    f"{what}: plain-PyTorch floor of a ZeRO-1/2 rank (no communication), CPU time per step, paired",
                    floor["cpu"],
                    "s",
                    base,
                    ref["cpu"] if ref else None,
                    ratio=_report.paired_ratio(floor["runs"], ref["runs"]) if ref else None,
                )
            )
    return rows


if __name__ == "__main__":
    main()
