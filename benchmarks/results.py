"""Run every benchmark (or collect their `--json` outputs) and write `benchmarks/RESULTS.md`.

    python benchmarks/results.py                  # every benchmark with its full settings (~20 min, 2 idle cores)
    python benchmarks/results.py --quick          # smaller sizes, fewer repeats: checks the pipeline, not the figures
    python benchmarks/results.py --only comm,zero # a subset: their parts of an existing RESULTS.md are replaced
    python benchmarks/results.py --collect DIR    # no runs: rows from DIR/*.json written by `<bench>.py --json`

`nox -s bench` installs the packages and runs this (arguments after `--` come here). Each benchmark
runs in its own process with `--json`; its stdout is shown as it runs and kept under `--out-dir`
(`<name>.txt`, `<name>.json` rows, `<name>.run.json` wall time and load). A benchmark that fails or
times out is reported in RESULTS.md and the rest still run; the exit status is then 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import _report
import _results_md
import _results_merge

HERE = Path(__file__).resolve().parent

# name: (arguments of the full run, arguments of --quick). The full settings are the benchmarks' own
# defaults unless noted; the wall times measured with them are in the "Runs" table of RESULTS.md.
SETTINGS: dict[str, tuple[list[str], list[str]]] = {
    "import_time": ([], ["--runs", "2"]),
    "op_build": ([], ["--trials", "1"]),
    "launch": ([], ["--repeats", "2"]),
    "comm": ([], ["--max-mib", "4", "--rounds", "3"]),
    "cpu_adam": ([], ["--sizes", "10000000", "--threads", "1", "--reps", "3"]),
    "engine_overhead": ([], ["--steps", "2", "--rounds", "2"]),
    "zero": ([], ["--steps", "3", "--modes", "ddp,stage2,fsdp2,stage3"]),  # RSS runs per mode dominate
    "superoffload": ([], ["--steps", "2"]),
    "superoffload_bf16": ([], ["--steps", "2"]),
    # inductor compiles the 21M GPT's forward and backward once per compiled mode (minutes on 2 loaded cores)
    "deepcompile": ([], ["--steps", "2", "--modes", "eager,deepcompile"]),
    "zenflow": ([], ["--steps", "8"]),
    "zenflow_1rank": ([], ["--steps", "8"]),
    "pipe": ([], ["--micro-batches", "4", "--repeats", "1", "--batches", "2"]),
    "loss_curves": ([], ["--steps", "10"]),
    "hf_trainer": ([], ["--steps", "6", "--rounds", "1", "--hidden", "64", "--layers", "2"]),
    "ulysses": ([], ["--lengths", "1024,2048", "--steps", "1", "--modes", "sp1,sp2"]),
    # full: 2 gloo ranks per measured length, FPDT checked at its fitted longest length (~17k tokens, ~6 min)
    "fpdt": ([], ["--lengths", "512,1024", "--chunk", "256"]),
    "moe": ([], ["--tokens", "256", "--steps", "2"]),
    "domino": ([], ["--hidden", "256", "--layers", "2", "--seq", "64", "--steps", "2"]),
    "hybrid_engine": ([], ["--hidden", "128", "--layers", "2", "--new-tokens", "8", "--reps", "1"]),
    # full: the 2.42B job from NVMe, ds alone (44-73 GB of swap files: the spare set of the updates during backward
    # takes what the disk has; DeepSpeed cannot run it here), 4 steps after the warm-up (the first one with
    # updates during backward also creates the spare files), ~4 min
    "infinity": (["--steps", "4"], ["--layers", "2", "--width", "2048", "--steps", "1", "--sides", "ds"]),
    "infinity_0.6b": ([], ["--layers", "1", "--width", "2048", "--steps", "1", "--sides", "ds"]),
    # full: up to 9 tuning experiments, 3 x 9 manual runs of the demo GPT at 2 ranks, and 5 x 2 back-to-back runs when
    # the tuned config is not the grid's best
    "autotuning": (
        [],
        ["--stages", "0,1", "--mbs", "4,8", "--manual-steps", "4", "--manual-rounds", "1", "--paired-rounds", "1"],
    ),
    # full: 0.6B bf16 parameters (1.2 GB a save), 3 reps of each contender after a warm-up, ~2.5 min
    "fast_writer": ([], ["--params", "5e7", "--reps", "2"]),
    # full: ~100M params fp32 + AdamW (1.2 GB a save), 3 reps of each way after a warm-up, ~1.5 min
    "decoupled_save": ([], ["--layers", "4", "--reps", "2"]),
    "bf16_masters": ([], ["--hidden", "128", "--layers", "2"]),  # 4 ZeRO-3 runs of 2 ranks, ~2 min loaded
    # full: ds beside DeepSpeed 0.19.8 and the plain-PyTorch floor of a ZeRO-1/2 rank, 5 paired rounds, ~10 min
    "zero_deepspeed": (["--sides", "ds,deepspeed,floor"], ["--stages", "2", "--rounds", "1", "--steps", "3"]),
}


#: Second runs of a script under their own name: name -> (script, its leading arguments).
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "aio_step": ("aio", ["--step"]),  # ZeRO-3 step: NVMe vs CPU offload
    "infinity_0.6b": ("infinity", ["--layers", "9", "--steps", "4"]),  # ds beside DeepSpeed where both run
    "superoffload_bf16": ("superoffload", ["--bf16"]),  # no step can be undone: no undo copies
    "zenflow_1rank": ("zenflow", ["--ranks", "1"]),  # the worker on the core the rank leaves idle
}

# torch 2.13 deprecates the *_tensor collectives ds_comm wraps; every rank of every run would say so.
CHILD_ENV = {"PYTHONWARNINGS": "ignore::FutureWarning:torch.distributed.c10d_logger"}


def discover() -> list[str]:
    """Every benchmark script: the known ones in SETTINGS order, then any other `benchmarks/*.py` (e.g. aio)."""
    # gpu.py needs a CUDA device and runs from tools/gpu_check.sh, on the GPU machine; zenflow_stage3_profile.py
    # prints a profile for reading, no figures.
    skip = ("results", "gpu", "zenflow_stage3_profile")
    found = {p.stem for p in HERE.glob("*.py") if not p.name.startswith("_") and p.stem not in skip}
    found |= {name for name, (script, _) in VARIANTS.items() if script in found}
    return [n for n in SETTINGS if n in found] + sorted(found - set(SETTINGS))


def cpu_busy_s() -> float | None:
    """CPU seconds all processes on this machine have used since boot (/proc/stat), None where unknown."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except (OSError, IndexError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    t = os.times()  # children: every finished process we waited for, and theirs (the rank processes)
    return t.user + t.system + t.children_user + t.children_system


def _become_subreaper() -> None:
    """Adopt the benchmarks' orphans (multiprocessing's forkserver outlives its parent by a moment).

    [Note: whose CPU time] A process's CPU time reaches us only when we, or a parent we reap, wait
    for it. Rank processes are children of a forkserver which their benchmark does not wait for;
    as a subreaper (Linux prctl) this process inherits it and reaps it, so the ranks' time counts as
    the benchmark's own and not as "other processes". Elsewhere this is a no-op.
    """
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def _reap_leftovers(group: int) -> None:
    """End what the benchmark left in its process group, and wait for every adopted orphan."""
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.05)


def _tee(proc: subprocess.Popen, log: Path, name: str) -> None:
    with log.open("w") as f:
        assert proc.stdout is not None
        for line in proc.stdout:
            f.write(line)
            f.flush()
            sys.stdout.write(f"[{name}] {line}")
            sys.stdout.flush()


def run_one(name: str, argv: list[str], out_dir: Path, timeout_s: float) -> dict:
    """Run one benchmark with `--json`, showing and saving its output; returns its run record."""
    rows_path = out_dir / f"{name}.json"
    rows_path.unlink(missing_ok=True)
    script, lead = VARIANTS.get(name, (name, []))
    argv = [*lead, *argv]
    cmd = [sys.executable, str(HERE / f"{script}.py"), *argv, "--json", str(rows_path)]
    print(f"\n=== {name}: {' '.join(['python', f'benchmarks/{script}.py', *argv])}", flush=True)
    load_before, busy_before, own_before = os.getloadavg(), cpu_busy_s(), _own_cpu_s()
    started = time.perf_counter()
    # Its own session, so a timeout ends the benchmark and the rank processes it started, nothing else.
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        start_new_session=True,
        cwd=HERE.parent,
        env={**os.environ, **CHILD_ENV},
    )
    timed_out = threading.Event()

    def kill() -> None:
        timed_out.set()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # it ended just now
            pass

    timer = threading.Timer(timeout_s, kill)
    timer.start()
    try:
        _tee(proc, out_dir / f"{name}.txt", name)
        rc = proc.wait()
    finally:
        timer.cancel()
        _reap_leftovers(proc.pid)
    seconds = time.perf_counter() - started
    busy_after, own_after = cpu_busy_s(), _own_cpu_s()
    # Cores that other processes kept busy meanwhile: the machine's CPU time minus ours, over the wall time.
    others = (
        None
        if busy_before is None or busy_after is None
        else max(0.0, (busy_after - busy_before) - (own_after - own_before)) / seconds
    )
    status = "timeout" if timed_out.is_set() else ("ok" if rc == 0 else f"failed (exit {rc})")
    if status == "ok" and not rows_path.exists():
        status = "no --json rows written"
    record = {
        "benchmark": name,
        "args": argv,
        "seconds": seconds,
        "status": status,
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "others_cores": others,
    }
    (out_dir / f"{name}.run.json").write_text(json.dumps(record, indent=1) + "\n")
    print(
        f"=== {name}: {status} in {seconds:.0f} s"
        + ("" if others is None else f"; other processes used {others:.2f} cores meanwhile"),
        flush=True,
    )
    return record


def collect(out_dir: Path, names: list[str] | None) -> tuple[list[_report.Row], list[dict], dict[str, str]]:
    """Rows, run records and raw outputs found in `out_dir` (only `names` when given)."""
    rows, runs, texts = [], [], {}
    order = {name: i for i, name in enumerate(discover())}

    def rank(path: Path) -> tuple[int, str]:
        stem = path.name.split(".")[0]
        return order.get(stem, len(order)), stem

    for path in sorted(out_dir.glob("*.json"), key=rank):
        if path.name.endswith(".run.json") or (names and path.stem not in names):
            continue
        try:
            rows += _report.read_rows(path)
        except (ValueError, TypeError) as err:  # json.JSONDecodeError is a ValueError
            rows.append(_report.Row(path.stem, f"unreadable --json output {path.name}: {err}", None, met=False))
    for path in sorted(out_dir.glob("*.run.json"), key=rank):
        record = json.loads(path.read_text())
        if not names or record["benchmark"] in names:
            runs.append(record)
    for path in sorted(out_dir.glob("*.txt"), key=rank):
        if not names or path.stem in names:
            texts[path.stem] = path.read_text()
    return rows, runs, texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes and few repeats (a check, not figures)")
    parser.add_argument("--only", default="", help="comma-separated benchmark names (default: all)")
    parser.add_argument(
        "--collect",
        type=Path,
        default=None,
        metavar="DIR",
        help="do not run anything: build RESULTS.md from DIR/*.json",
    )
    parser.add_argument("--out-dir", type=Path, default=HERE / "out", help="where raw outputs go")
    parser.add_argument("--output", type=Path, default=HERE / "RESULTS.md")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per benchmark before it is killed")
    parser.add_argument("--label", default="", help="a note for the header (e.g. 'loaded machine')")
    args = parser.parse_args()
    available = discover()
    names = [n for n in args.only.split(",") if n] or available
    unknown = sorted(set(names) - set(available))
    if unknown:
        parser.error(f"--only: unknown benchmark(s) {unknown}; available: {available}")
    machine = _results_md.machine_info(HERE.parent)
    _become_subreaper()
    load_before = os.getloadavg()
    started = time.perf_counter()
    if args.collect is None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        for name in names:
            full, quick = SETTINGS.get(name, ([], []))
            argv = list(quick if args.quick else full)
            if name in ("loss_curves", "ulysses") and args.output.resolve().parent != HERE:
                argv += ["--out-dir", str(args.output.resolve().parent)]  # its plot goes next to RESULTS.md
            if name == "infinity":  # its per-phase chart goes next to RESULTS.md
                argv += ["--plot", str(args.output.resolve().parent / "infinity.svg")]
            run_one(name, argv, args.out_dir, args.timeout)
    source = args.collect if args.collect is not None else args.out_dir
    rows, runs, texts = collect(source, None if args.collect is not None and not args.only else names)
    total_s, loads = time.perf_counter() - started, (load_before, os.getloadavg())
    if args.collect and runs:  # the figures' own run, not this invocation
        total_s, loads = sum(r["seconds"] for r in runs), (runs[0]["load_before"], runs[-1]["load_after"])
    command = shlex.join(["python", "benchmarks/results.py", *sys.argv[1:]])
    text = _results_md.render(
        machine=machine,
        rows=rows,
        runs=runs,
        texts=texts,
        quick=args.quick,
        label=args.label,
        loads=loads,
        total_s=total_s,
        plot=args.output.parent / "loss_curves.svg",
        command=command,
    )
    if args.only and args.output.exists():
        # Only these benchmarks ran: the rest of the page keeps the figures of the run it describes.
        busy = _results_md.shared_machine(loads, runs)
        note = (
            f"**{', '.join(names)}** re-run by `{command}` at {machine['commit']} on {machine['date']}"
            f"{', on a loaded machine' if busy else ''} "
            f"(load average 1/5/15 min before / after: {_results_md.format_loads(loads)}); their figures, "
            "runs, plots and raw output come from that run, everything else from the run described below."
        )
        text = _results_merge.merge_pages(args.output.read_text(), text, names, discover(), note)
    args.output.write_text(text)
    print(f"\nwrote {args.output} ({len(rows)} figures from {len(runs)} benchmark runs)")
    failed = [r["benchmark"] for r in runs if r["status"] != "ok"]
    if failed:
        print(f"FAILED: {', '.join(failed)} (see {args.output})")
        sys.exit(1)


if __name__ == "__main__":
    main()
