"""One GPU: FusedAdam's step against torch's fused AdamW (100M-1B parameters); a ~1.3B GPT in bf16 under plain
PyTorch, ds ZeRO-0, ds ZeRO-Offload and FSDP2 with CPU offload; the largest GPT that trains with ZeRO-Offload
and with ZeRO-Infinity (NVMe).

    python benchmarks/gpu.py [--quick] [--plan] [--deadline-s 300] [--only torch,zero0,...]
    python benchmarks/gpu.py --cpu-smoke     # the same plan on the CPU with a tiny model: checks the code only

`tools/gpu_check.sh` runs it with `--quick` and what is left of its budget. Each measurement runs in
its own process (`benchmarks/_gpu_modes.py`, which says what each mode is) under a time cap, so one
that fails, runs out of memory or overruns leaves the rest measured. Figures: tokens/s (median step
after a warm-up) and peak GPU memory (allocated and reserved), peak host RSS; the ratios are against
plain PyTorch + fused AdamW for ZeRO-0, and against FSDP2 + `CPUOffloadPolicy` for ZeRO-Offload.

Optimizer step (`benchmarks/_gpu_fused_adam.py`): fp32 parameters in 16M-element tensors, median of
CUDA-event-timed steps, each optimizer alone on the device.

Model: examples/gpt.py's GPT, width 2048, 16 heads, 24 layers, vocabulary 50304, 1024-token sequences
(1.31B parameters, tied embeddings). The micro batch is sized to the card: the largest power of two
whose estimated activations (~2.5 GiB per sequence without checkpointing) plus plain PyTorch's
16 bytes per parameter of states fit in 60% of the GPU's memory (16 on an H200).

Size search: the same width, micro batch 4, the layer count doubled from 48 until a step fails (out
of memory) or overruns its cap, then bisected, all under the search's hard time cap. A size whose
estimated host memory (ZeRO-Offload: 16 bytes per parameter, pinned) or swap space (ZeRO-Infinity:
18 bytes per parameter) exceeds what the machine has is not tried: it counts as too large, said so.
The answer is the largest size that trained, with the reason the search stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import _report

HERE = Path(__file__).resolve().parent
MODES_SCRIPT = HERE / "_gpu_modes.py"
ADAM_SCRIPT = HERE / "_gpu_fused_adam.py"
ADAM_CAP_S = 90
LABELS = {
    "torch": "plain PyTorch + fused AdamW",
    "zero0": "ds ZeRO-0",
    "offload": "ds ZeRO-Offload (CPU Adam)",
    "fsdp2_offload": "FSDP2 + CPUOffloadPolicy",
    "infinity": "ds ZeRO-Infinity (NVMe)",
}
BASELINES = {"zero0": "torch", "offload": "fsdp2_offload"}
HOST_GIB_DEFAULT = 128  # the H200 machine's memory (KINDS.md); MemTotal there starts lower and grows


@dataclass(frozen=True)
class Shape:
    dim: int
    heads: int
    vocab: int
    seq: int

    def params(self, layers: int) -> int:
        return layers * (12 * self.dim * self.dim + 13 * self.dim) + (self.vocab + self.seq) * self.dim


@dataclass(frozen=True)
class Measure:
    mode: str
    layers: int
    batch: int
    warmup: int
    steps: int
    cap_s: float


@dataclass(frozen=True)
class Search:
    mode: str
    start_layers: int
    batch: int
    cap_s: float
    probe_cap_s: float


@dataclass
class Plan:
    shape: Shape
    adam_sizes: list[int]
    """Parameter counts at which FusedAdam's step is timed against torch's fused AdamW (empty: not timed)."""
    measures: list[Measure]
    searches: list[Search]
    device: str
    gpu_gib: float | None
    host_gib: float
    disk_gib: float
    cpu: bool

    def lines(self) -> list[str]:
        s = self.shape
        out = [
            f"device: {self.device}; GPU memory {self.gpu_gib} GiB; host limit {self.host_gib:.0f} GiB; "
            f"swap space {self.disk_gib:.0f} GiB"
        ]
        if self.adam_sizes:
            out.append(
                f"  optimizer step: FusedAdam vs torch AdamW(fused=True), fp32, "
                f"{', '.join(_size(n) for n in self.adam_sizes)} parameters, cap {ADAM_CAP_S} s"
            )
        out.append(f"model: GPT width {s.dim}, {s.heads} heads, vocab {s.vocab}, seq {s.seq}, bf16")
        for m in self.measures:
            out.append(
                f"  measure {m.mode:<14} {LABELS[m.mode]:<30} {m.layers} layers "
                f"({_size(s.params(m.layers))}), batch {m.batch}x{s.seq}, {m.warmup} warm-up + "
                f"{m.steps} timed steps, cap {m.cap_s:.0f} s"
            )
        for q in self.searches:
            out.append(
                f"  search  {q.mode:<14} {LABELS[q.mode]:<30} layers doubled from {q.start_layers} "
                f"({_size(s.params(q.start_layers))}), batch {q.batch}, probe cap {q.probe_cap_s:.0f} s, "
                f"search cap {q.cap_s:.0f} s"
            )
        return out


def _gpu_gib() -> float | None:
    """The first GPU's memory: nvidia-smi, else torch in a child (this process keeps no CUDA context)."""
    probes = (
        ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
        [
            sys.executable,
            "-c",
            "import torch; print(torch.cuda.get_device_properties(0).total_memory // 2**20 "
            "if torch.cuda.is_available() else '')",
        ],
    )
    for cmd in probes:
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout
            return round(int(out.splitlines()[0]) / 1024, 1)
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            continue
    return None


def _mem_available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return 8.0


def batch_for(gpu_gib: float, shape: Shape, layers: int) -> int:
    """The largest power of two (<= 64) whose activations plus fp32 Adam states fit 60% of the card."""
    per_sequence_gib = 2.5 * layers / 24 * shape.dim / 2048 * shape.seq / 1024
    room = 0.6 * gpu_gib - 16 * shape.params(layers) / 2**30
    batch = 1
    while batch < 64 and (2 * batch) * per_sequence_gib <= room:
        batch *= 2
    return batch


def make_plan(args: argparse.Namespace) -> Plan:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    disk_gib = shutil.disk_usage(work).free / 2**30
    if args.cpu_smoke:
        shape = Shape(dim=64, heads=2, vocab=256, seq=32)
        measures = [Measure(m, 2, 2, 1, 2, 120) for m in ("torch", "zero0", "offload", "fsdp2_offload")]
        searches = [Search("offload", 2, 2, 30, 25), Search("infinity", 2, 2, 30, 25)]
        return Plan(
            shape,
            [1_000_000],
            measures,
            searches,
            "cpu (smoke run: no figures)",
            None,
            min(args.host_gib or _mem_available_gib(), _mem_available_gib()) * 0.5,
            disk_gib * 0.5,
            cpu=True,
        )
    shape = Shape(dim=2048, heads=16, vocab=50304, seq=1024)
    gpu_gib = _gpu_gib()
    batch = batch_for(gpu_gib or 80.0, shape, 24)
    warmup, steps, cap, search_cap = (2, 3, 75, 75) if args.quick else (3, 10, 180, 300)
    measures = [
        Measure("torch", 24, batch, warmup, steps, cap),
        Measure("zero0", 24, batch, warmup, steps, cap),
        Measure("offload", 24, batch, warmup, steps, cap + 30),
        Measure("fsdp2_offload", 24, batch, warmup, steps, cap + 30),
    ]
    searches = [
        Search("offload", 48, 4, search_cap, search_cap * 0.8),
        Search("infinity", 48, 4, search_cap, search_cap * 0.8),
    ]
    # Half the host memory at most: a machine whose memory grows on demand may not survive an overcommit.
    return Plan(
        shape,
        [100_000_000, 300_000_000, 1_000_000_000],
        measures,
        searches,
        "cuda",
        gpu_gib,
        0.5 * (args.host_gib or HOST_GIB_DEFAULT),
        0.8 * disk_gib,
        cpu=False,
    )


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class Runner:
    """Starts measurements as child processes, each killed at its cap or at the overall deadline."""

    def __init__(self, plan: Plan, work: Path, deadline: float) -> None:
        self.plan, self.work, self.deadline = plan, work, deadline

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, mode: str, layers: int, batch: int, warmup: int, steps: int, cap_s: float) -> dict[str, Any]:
        """One training measurement (`_gpu_modes.py`)."""
        s = self.plan.shape
        record: dict[str, Any] = {"mode": mode, "layers": layers, "batch": batch, "params": s.params(layers)}
        nvme = self.work / "nvme"
        shutil.rmtree(nvme, ignore_errors=True)
        cmd = [
            sys.executable,
            str(MODES_SCRIPT),
            mode,
            "--layers",
            str(layers),
            "--dim",
            str(s.dim),
            "--heads",
            str(s.heads),
            "--vocab",
            str(s.vocab),
            "--seq",
            str(s.seq),
            "--batch",
            str(batch),
            "--warmup",
            str(warmup),
            "--steps",
            str(steps),
            "--nvme",
            str(nvme),
            *(["--cpu"] if self.plan.cpu else []),
        ]
        record = self.spawn(cmd, cap_s, f"{mode} {layers} layers ({_size(s.params(layers))}), batch {batch}", record)
        shutil.rmtree(nvme, ignore_errors=True)
        return record

    def spawn(self, cmd: list[str], cap_s: float, what: str, record: dict[str, Any]) -> dict[str, Any]:
        """Run a child that prints `RESULT <json>` last; killed at `cap_s` or the deadline, whichever is first."""
        cap = min(cap_s, self.left())
        if cap < 15:
            return {**record, "status": "skipped", "reason": f"{cap:.0f} s left before the deadline"}
        print(f"--- {what}, cap {cap:.0f} s", flush=True)
        started = time.monotonic()
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            errors="replace",
            start_new_session=True,
        )
        seen: dict[str, Any] = {"result": None, "tail": []}

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                line = line.rstrip()
                if line.startswith("RESULT "):
                    seen["result"] = json.loads(line[len("RESULT ") :])
                else:
                    print(f"    {line}", flush=True)
                    seen["tail"] = (seen["tail"] + [line])[-8:]

        reader = threading.Thread(target=pump, daemon=True)  # the wait below, not the pipe, keeps the cap
        reader.start()
        timed_out = False
        try:
            rc = proc.wait(timeout=cap)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc.pid)
            rc = proc.wait()
        finally:
            _kill_group(proc.pid)
        reader.join(timeout=10)
        result, tail = seen["result"], seen["tail"]
        record["wall_s"] = round(time.monotonic() - started, 1)
        if timed_out:
            return {**record, "status": "timeout", "reason": f"over its {cap:.0f} s cap", "tail": tail}
        if result is None or rc != 0:
            return {**record, "status": "failed", "rc": rc, "tail": tail}
        record.update(result)
        record["status"] = "oom" if result.get("oom") else "ok"
        return record


def search(runner: Runner, q: Search) -> dict[str, Any]:
    """Double the layer count from `q.start_layers` until a probe fails, then bisect; all within `q.cap_s`."""
    plan, s = runner.plan, runner.plan.shape
    end = min(runner.deadline, time.monotonic() + q.cap_s)
    largest: dict[str, Any] | None = None
    too_large: int | None = None
    probes, stopped = [], "cap reached"
    layers = q.start_layers
    while True:
        params = s.params(layers)
        host_gib, disk_gib = 16 * params / 2**30, 18 * params / 2**30
        if q.mode == "offload" and host_gib > plan.host_gib:
            probes.append(
                {
                    "layers": layers,
                    "params": params,
                    "status": "not tried",
                    "reason": f"needs ~{host_gib:.0f} GiB pinned host memory > {plan.host_gib:.0f} GiB",
                }
            )
            too_large = layers
        elif q.mode == "infinity" and disk_gib > plan.disk_gib:
            probes.append(
                {
                    "layers": layers,
                    "params": params,
                    "status": "not tried",
                    "reason": f"needs ~{disk_gib:.0f} GiB swap space > {plan.disk_gib:.0f} GiB free",
                }
            )
            too_large = layers
        else:
            left = end - time.monotonic()
            if left < 20:
                break
            cap = min(q.probe_cap_s, left)
            record = runner.run(q.mode, layers, q.batch, 1, 1, cap)
            probes.append(record)
            if record["status"] == "ok":
                largest = record
            elif record["status"] == "timeout" and cap < q.probe_cap_s:
                stopped = f"cap reached during the probe at {layers} layers"  # says nothing about the size
                break
            elif record["status"] in ("oom", "timeout"):
                too_large = layers
            else:
                stopped = f"probe at {layers} layers {record['status']}"
                break
        low = largest["layers"] if largest else 0
        if too_large is None:
            layers *= 2
        elif too_large - low <= max(1, low // 4):
            stopped = "bracketed to within 25%" if largest else "the first size did not train"
            break
        else:
            layers = (low + too_large) // 2 if largest else max(1, too_large // 2)
            if layers in (low, too_large):
                break
    bound = next((p for p in probes if p["layers"] == too_large), None)
    return {
        "mode": q.mode,
        "label": LABELS[q.mode],
        "largest": largest,
        "too_large_layers": too_large,
        "too_large_because": None if bound is None else bound.get("reason", bound["status"]),
        "stopped": stopped,
        "probes": probes,
    }


def _fmt(value: float | None, spec: str) -> str:
    width = int("".join(c for c in spec.split(".")[0] if c.isdigit()) or 0)
    return "-".rjust(width) if value is None else format(value, spec)


def _size(params: int) -> str:
    return f"{params / 1e9:.2f}B" if params >= 1e8 else f"{params / 1e6:.2f}M"


def report(
    plan: Plan, adam: dict[str, Any] | None, measures: list[dict[str, Any]], searches: list[dict[str, Any]]
) -> tuple[list[str], list]:
    """The human table and the `_report.Row`s."""
    by_mode = {m["mode"]: m for m in measures}
    lines, rows = [], []
    if adam is not None:
        lines.append(f"{'optimizer step (fp32)':<32} {'status':<8} {'FusedAdam ms':>13} {'torch ms':>9} {'ratio':>6}")
        for size in adam.get("sizes", []):
            lines.append(
                f"{_size(size['params']):<32} {adam['status']:<8} {_fmt(size['fused_adam_ms'], '13.2f')} "
                f"{_fmt(size['torch_ms'], '9.2f')} {_fmt(size['ratio'], '6.2f')}"
            )
            if not plan.cpu and size["fused_adam_ms"] is not None:
                rows.append(
                    _report.Row(
                        "gpu",
                        f"FusedAdam step, {_size(size['params'])} fp32 parameters",
                        round(size["fused_adam_ms"], 3),
                        "ms",
                        "torch AdamW(fused=True)",
                        round(size["torch_ms"], 3),
                    )
                )
        if not adam.get("sizes"):
            lines.append(f"{'FusedAdam vs torch':<32} {adam['status']:<8}")
    lines += [
        f"{'run':<32} {'status':<8} {'tokens/s':>10} {'step s':>8} {'GPU alloc GiB':>14} {'GPU resv GiB':>13} "
        f"{'host RSS GiB':>13} {'vs':>6}"
    ]
    for m in measures:
        base = by_mode.get(BASELINES.get(m["mode"], ""))
        ratio = (
            (m["tokens_per_s"] / base["tokens_per_s"])
            if base and base.get("status") == "ok" and m.get("status") == "ok"
            else None
        )
        lines.append(
            f"{LABELS[m['mode']]:<32} {m['status']:<8} {_fmt(m.get('tokens_per_s'), '10.0f')} "
            f"{_fmt(m.get('step_s'), '8.3f')} {_fmt(m.get('gpu_peak_allocated_gib'), '14.1f')} "
            f"{_fmt(m.get('gpu_peak_reserved_gib'), '13.1f')} {_fmt(m.get('host_peak_rss_gib'), '13.1f')} "
            f"{_fmt(ratio, '6.2f')}"
        )
        if plan.cpu or m.get("status") != "ok":
            continue
        setting = f"{_size(m['params'])} GPT bf16, batch {m['batch']}x{plan.shape.seq}"
        base_label = LABELS[base["mode"]] if base else ""
        base_ok = base is not None and base.get("status") == "ok"
        rows.append(
            _report.Row(
                "gpu",
                f"{LABELS[m['mode']]} tokens/s, {setting}",
                round(m["tokens_per_s"], 1),
                "tokens/s",
                base_label,
                round(base["tokens_per_s"], 1) if base_ok else None,
            )
        )
        if "gpu_peak_allocated_gib" in m:
            rows.append(
                _report.Row(
                    "gpu",
                    f"{LABELS[m['mode']]} peak GPU memory, {setting}",
                    round(m["gpu_peak_allocated_gib"], 2),
                    "GiB",
                    base_label,
                    round(base["gpu_peak_allocated_gib"], 2) if base_ok else None,
                )
            )
    for q in searches:
        big = q["largest"]
        text = (
            "none trained"
            if big is None
            else f"{_size(big['params'])} ({big['layers']} layers), {big['tokens_per_s']:.0f} tokens/s"
        )
        bound = (
            ""
            if q["too_large_layers"] is None
            else f"; {q['too_large_layers']} layers too large ({q['too_large_because']})"
        )
        lines.append(f"largest with {q['label']}: {text}{bound}; stopped: {q['stopped']}")
        if big is not None and not plan.cpu:
            rows.append(
                _report.Row(
                    "gpu",
                    f"largest GPT trained, {q['label']} (width {plan.shape.dim}, batch "
                    f"{big['batch']}; search {q['stopped']})",
                    round(big["params"] / 1e9, 2),
                    "B params",
                )
            )
    return lines, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and shorter caps (fits tools/gpu_check.sh)")
    parser.add_argument("--cpu-smoke", action="store_true", help="the plan on the CPU with a tiny model (no figures)")
    parser.add_argument("--plan", action="store_true", help="print the plan and exit")
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated: fused_adam, torch, zero0, offload, fsdp2_offload, search_offload, search_infinity",
    )
    parser.add_argument("--deadline-s", type=float, default=1800, help="stop starting work after this many seconds")
    parser.add_argument("--host-gib", type=float, default=None, help="host memory to size the offload search by")
    parser.add_argument(
        "--work",
        type=Path,
        default=HERE.parent / "build" / "gpu_bench",
        help="scratch folder on a real disk (the NVMe swap files go under it; /tmp may be memory)",
    )
    parser.add_argument("--details", type=Path, default=None, help="write every record and the table as JSON here")
    parser.add_argument("--json", type=Path, default=None, help="write the figures as benchmark rows (see _report)")
    args = parser.parse_args()
    deadline = time.monotonic() + args.deadline_s
    plan = make_plan(args)
    wanted = {w.strip() for w in args.only.split(",") if w.strip()}
    known = {*LABELS, "fused_adam"} | {f"search_{m}" for m in LABELS}
    if wanted - known:
        parser.error(f"--only: unknown {', '.join(sorted(wanted - known))}; choose from {', '.join(sorted(known))}")
    if wanted:
        plan.adam_sizes = plan.adam_sizes if "fused_adam" in wanted else []
        plan.measures = [m for m in plan.measures if m.mode in wanted]
        plan.searches = [q for q in plan.searches if f"search_{q.mode}" in wanted]
    print("\n".join(["benchmark plan" + (" (quick)" if args.quick else ""), *plan.lines()]), flush=True)
    if args.plan:
        return
    if not plan.cpu and plan.gpu_gib is None:
        raise SystemExit("benchmarks/gpu.py: no NVIDIA GPU found (nvidia-smi); --cpu-smoke runs the code on the CPU")
    runner = Runner(plan, args.work, deadline)
    adam = None
    if plan.adam_sizes:
        cmd = [
            sys.executable,
            str(ADAM_SCRIPT),
            "--sizes",
            ",".join(map(str, plan.adam_sizes)),
            *(["--cpu", "--steps", "3"] if plan.cpu else []),
        ]
        adam = runner.spawn(cmd, ADAM_CAP_S, "FusedAdam vs torch AdamW(fused=True)", {"mode": "fused_adam"})
    measures = [runner.run(m.mode, m.layers, m.batch, m.warmup, m.steps, m.cap_s) for m in plan.measures]
    searches = [search(runner, q) for q in plan.searches]
    lines, rows = report(plan, adam, measures, searches)
    print("\n".join(lines), flush=True)
    if args.details:
        args.details.write_text(
            json.dumps(
                {
                    "plan": asdict(plan),
                    "fused_adam": adam,
                    "measurements": measures,
                    "searches": searches,
                    "table": lines,
                },
                indent=1,
                default=str,
            )
            + "\n"
        )
    if args.json:
        _report.write_rows(args.json, rows)
    failed = [m["mode"] for m in [*([adam] if adam else []), *measures] if m["status"] not in ("ok", "skipped")]
    if failed:
        raise SystemExit(f"benchmarks/gpu.py: {', '.join(failed)} did not measure (see above)")


if __name__ == "__main__":
    main()
