"""DeepCompile at ZeRO-3 on 2 gloo ranks: step time and memory against ds's eager ZeRO-3.

Run: python benchmarks/deepcompile.py [--steps 6] [--batch 4] [--seq 64] [--modes eager,torch_compile,deepcompile]
     [--backend inductor|aot_eager|eager]
Model: the GPT-style decoder of `zero.py` (~21M parameters, 10 layers of width 384), AdamW, fp32, ZeRO stage 3
through `ds_engine.initialize` (every parameter partitioned: `stage3_param_persistence_threshold` 0), one
micro-step per step. Modes, each in its own pair of fresh rank processes:

* eager: ds's ZeRO-3, module hooks gather and release around each module;
* torch_compile: `engine.compile()` without DeepCompile, the module compiled under the eager hooks;
* deepcompile: `compile.deepcompile: true` + `engine.compile()`, gathers/releases in the graphs; after 5
  steps selective unsharding keeps whole what fits in memory (here: the whole model) and recompiles.

`--backend` (default inductor) compiles both compiled modes; eager/aot_eager skip inductor's minutes of
C++ compilation (the graphs and their schedule are the same, run as Python). The first step of a compiled
mode compiles (its time is reported as compile time); steps 2-5 are reported as "sharded" (DeepCompile
with every gather in its graphs: median step time and heap peak); step 6 makes the unsharding choice and
compiles again, and after one more warm-up step the median of `--steps` steps is reported, for the slower
rank (every mode runs the same sequence). Memory, for the slower rank: the resident set after the timed
steps (steady state), the peak over the process (the compiler's own included), the peak RSS during the
timed steps (VmHWM reset before them), and the peak of the in-use heap during the timed steps (`HeapPeak`:
tensors' storage, without the code and libraries in RSS; "rise" is that peak less the heap at their start).
The compiled modes' RSS holds Dynamo's and AOTAutograd's code and compile state (about 90-130 MiB in a
fresh process, measured by importing and compiling a small module) that no schedule can remove; the heap
peak is what the schedule decides. Targets: DeepCompile <= 0.8x eager's step time and no higher heap peak
(after selective unsharding every rank holds the whole model, as DeepSpeed's would where it fits; the
steps 2-5 heap peak is the gather schedule's own).
"""

from __future__ import annotations

import argparse
import ctypes
import resource
import statistics
import threading
import time
from pathlib import Path

import _report
import torch
import torch.nn.functional as F
from zero import GPT

from ds_comm.testing import run_ranks

MODES = ("eager", "torch_compile", "deepcompile")
KEYS = ("first", "sharded", "sharded_heap_peak", "wall", "rss", "peak_rss", "step_peak_rss", "heap_peak", "heap_rise")
TARGETS = {("deepcompile", "wall"): "<= 0.8", ("deepcompile", "heap_peak"): "<= 1"}


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


class _MallinfoT(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks".split()]
    _fields_ += [(name, ctypes.c_size_t) for name in ("uordblks", "fordblks", "keepcost")]


class HeapPeak:
    """The peak of glibc's in-use heap (`mallinfo2`: small blocks + mmapped blocks) while it runs.

    Tensors' CPU storage comes from malloc, so this is close to the peak of live tensor bytes (plus the
    interpreter's own large objects), unlike RSS, which also holds code and the compiler's libraries.
    A thread samples every 0.5 ms; CPU ops release the GIL, so it sees inside a step. Not on glibc: nan."""

    def __init__(self) -> None:
        try:
            self._fn = ctypes.CDLL("libc.so.6").mallinfo2
            self._fn.restype = _MallinfoT
        except (OSError, AttributeError):
            self._fn = None
        self.peak = self.start = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _now(self) -> int:
        info = self._fn()
        return int(info.uordblks + info.hblkhd)

    def _run(self) -> None:
        while not self._stop.wait(0.0005):
            self.peak = max(self.peak, self._now())

    def __enter__(self) -> HeapPeak:
        if self._fn is not None:
            self.peak = self.start = self._now()
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._fn is not None:
            self._thread.join()

    def mib(self, value: int) -> float:
        return value / 2**20 if self._fn is not None else float("nan")


def _step_peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _job(rank: int, world: int, mode: str, steps: int, batch: int, seq: int, backend: str) -> dict:
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
        engine.compile(backend=backend)
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
    with HeapPeak() as sharded_heap:  # DeepCompile: every parameter still gathered in the graphs
        sharded = [step() for _ in range(4)]
    step()  # DeepCompile: selective unsharding after 5 steps, and the module compiled again
    step()
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS: the steps' own peak from here
    except OSError:
        pass
    with HeapPeak() as heap:
        times = [step() for _ in range(steps)]
    return {
        "first": first,
        "sharded": statistics.median(sharded),
        "sharded_heap_peak": sharded_heap.mib(sharded_heap.peak),
        "wall": statistics.median(times),
        "rss": _rss_mib(),
        "peak_rss": max(peak_rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "step_peak_rss": _step_peak_rss_mib(),
        "heap_peak": heap.mib(heap.peak),
        "heap_rise": heap.mib(heap.peak - heap.start),
        "active": engine.is_deepcompile_active(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument(
        "--backend", default="inductor", help="compiled modes' backend; eager/aot_eager skip inductor's slow compile"
    )
    _report.add_json_argument(parser)
    args = parser.parse_args()
    rows: dict[str, dict] = {}
    for mode in args.modes.split(","):
        per_rank = run_ranks(2, _job, mode, args.steps, args.batch, args.seq, args.backend, timeout_s=1800)
        rows[mode] = {k: max(r[k] for r in per_rank) for k in KEYS}
        rows[mode]["active"] = all(r["active"] for r in per_rank)
        r = rows[mode]
        print(
            f"{mode:14s} step {r['wall'] * 1e3:8.1f} ms (steps 2-5 {r['sharded'] * 1e3:8.1f})  "
            f"first step {r['first']:7.1f} s  "
            f"RSS {r['rss']:6.0f} MiB  peak {r['peak_rss']:6.0f}  step peak {r['step_peak_rss']:6.0f}  "
            f"heap peak {r['heap_peak']:6.0f} (rise {r['heap_rise']:5.0f}) MiB  deepcompile active: {r['active']}",
            flush=True,
        )
    if "eager" in rows:
        for mode in rows:
            if mode != "eager":
                ratios = ", ".join(f"{k} {rows[mode][k] / rows['eager'][k]:.3f}x" for k in KEYS[1:])
                print(f"{mode}/eager: {ratios}")
    _report.write_rows(args.json, _json_rows(rows, args.steps))


def _json_rows(rows: dict[str, dict], steps: int) -> list[_report.Row]:
    out = []
    if "eager" not in rows:
        return out
    for mode in rows:
        if mode == "eager":
            continue
        for key, label, unit in (
            ("sharded", "step wall time, steps 2-5 (before selective unsharding)", "s"),
            ("sharded_heap_peak", "heap peak during steps 2-5 (before selective unsharding)", "MiB"),
            ("wall", f"step wall time, median of {steps}", "s"),
            ("rss", "steady-state RSS (the compiler's libraries included)", "MiB"),
            ("peak_rss", "peak RSS (compiler included)", "MiB"),
            ("step_peak_rss", "peak RSS during the timed steps", "MiB"),
            ("heap_peak", "heap peak during the timed steps (tensors)", "MiB"),
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
