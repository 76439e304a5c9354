"""RESULTS.md for `benchmarks/results.py`: the machine, one table of every figure, the loss curves, the runs.

Kept apart from the runner so the page's layout can be read (and changed) in one place.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
from pathlib import Path

from _report import Row

QUIET_LOAD = 0.5
"""A 1-minute load average above this before the run means the machine was not idle when it started."""
QUIET_OTHERS = 0.25
"""Cores that other processes kept busy during a benchmark (on average) above which it shared the machine."""
LOSS_HEADING = "## Loss curves: DDP vs ZeRO 1/2/3 vs pipeline"
ULYSSES_HEADING = "## Ulysses sequence parallelism: activation memory and step time vs sequence length"
INFINITY_HEADING = "## ZeRO-Infinity: where a step's seconds go"
PLOT_OWNERS = {LOSS_HEADING: "loss_curves", ULYSSES_HEADING: "ulysses", INFINITY_HEADING: "infinity"}
"""The benchmark whose run each plot section shows (`results.py --only` replaces it with that benchmark's)."""


def _first(path: str, key: str) -> str:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def _git(root: Path, *args: str) -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_info(root: Path) -> dict[str, str]:
    """What the figures depend on: CPU, cores, memory, OS, Python, torch, the commit, the date."""
    import torch

    mem_kib = _first("/proc/meminfo", "MemTotal").split()[0]
    commit = _git(root, "rev-parse", "--short=12", "HEAD") or "unknown (not a git checkout)"
    if _git(root, "status", "--porcelain", "--untracked-files=no"):
        commit += " + uncommitted changes"
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "CPU": _first("/proc/cpuinfo", "model name"),
        "cores": f"{usable} usable of {os.cpu_count()}",
        "memory": f"{int(mem_kib) / 2**20:.1f} GiB" if mem_kib.isdigit() else "unknown",
        "OS": f"{platform.system()} {platform.release()} ({platform.platform()})",
        "Python": platform.python_version(),
        "torch": torch.__version__,
        "commit": commit,
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def _num(value: float | None, unit: str = "") -> str:
    if value is None:
        return ""
    text = f"{value:.4g}"
    return f"{text} {unit}" if unit else text


def _met(met: bool | None) -> str:
    return "" if met is None else ("yes" if met else "**no**")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _table(rows: list[Row]) -> list[str]:
    out = [
        "| benchmark | figure | value | baseline | baseline value | ratio | target | met |",
        "| --- | --- | ---: | --- | ---: | ---: | --- | --- |",
    ]
    for r in rows:
        out.append(
            f"| {r.benchmark} | {_cell(r.figure)} | {_num(r.value, r.unit)} | {_cell(r.baseline)} | "
            f"{_num(r.baseline_value, r.unit)} | {_num(r.ratio)} | {_cell(r.target)} | {_met(r.met)} |"
        )
    return out


def format_loads(loads: tuple[tuple[float, ...], tuple[float, ...]]) -> str:
    """`(before, after)` load averages as `b1 b5 b15 / a1 a5 a15`."""
    return " / ".join(" ".join(f"{x:.2f}" for x in load) for load in loads)


def shared_machine(loads: tuple, runs: list[dict]) -> bool:
    """Whether the run shared the machine: other processes busy during a benchmark, measured (/proc/stat); where
    that was not measured, a load average above `QUIET_LOAD` when the run started. (The load average is the
    minute before the start, work that may have ended; the measurement is the benchmarks' own time.)"""
    others = [r["others_cores"] for r in runs if r.get("others_cores") is not None]
    if others:
        return any(o > QUIET_OTHERS for o in others)
    return loads[0][0] > QUIET_LOAD


def _header(
    machine: dict[str, str], loads: tuple, runs: list[dict], quick: bool, label: str, command: str, total_s: float
) -> list[str]:
    out = ["# Benchmark results", ""]
    others = [r["others_cores"] for r in runs if r.get("others_cores") is not None]
    busy = shared_machine(loads, runs)
    if quick or label or busy:
        what = [
            "**--quick run** (small sizes, few repeats)" if quick else "",
            "**on a loaded machine**" if busy else "",
            f"**{label}**" if label else "",
        ]
        caveat = (
            ": these figures check that the benchmarks run; they are not the project's figures. Regenerate "
            "with `nox -s bench` on a quiet machine."
            if quick or busy
            else "."
        )
        out += [f"> {', '.join(w for w in what if w)}{caveat}", ""]
    out += [
        f"Generated by `{command}` (`nox -s bench`); the benchmarks took {total_s / 60:.1f} min.",
        "",
        "| machine | |",
        "| --- | --- |",
    ]
    out += [f"| {k} | {_cell(v)} |" for k, v in machine.items()]
    out += [f"| load average 1/5/15 min, before / after the run | {format_loads(loads)} |"]
    if others:
        out.append(
            f"| other processes' CPU use during the benchmarks | up to {max(others):.2f} cores "
            f"(mean {sum(others) / len(others):.2f}) |"
        )
    out += [
        "",
        "The figures are only meaningful on a quiet machine: the benchmarks interleave each measurement "
        "with its baseline so slow drift hits both alike, but other processes competing for the same "
        f"cores still distort ratios. Other processes keeping more than {QUIET_OTHERS} cores busy during a "
        "benchmark (the Runs table: the machine's CPU time from /proc/stat minus the benchmark's own) means "
        f"the run shared the machine (where that was not measured: a 1-minute load average above {QUIET_LOAD} "
        "before the run). The load average after the run includes the benchmarks' own load.",
        "",
    ]
    return out


def _loss_section(rows: list[Row], plot: Path) -> list[str]:
    out = [LOSS_HEADING, ""]
    if plot.exists():
        out += [f"![loss curves]({plot.name})", ""]
    else:
        out += [f"(no {plot.name} next to this file: loss_curves.py did not run into this directory)", ""]
    curves = [r for r in rows if r.benchmark == "loss_curves"]
    if curves:
        out += [
            "Same initial weights, the same global batches, fp32, torch AdamW with clipping; "
            "per mode, from the same run (`benchmarks/loss_curves.py`, data in `loss_curves.csv`):",
            "",
        ]
        out += _table(curves)
        out.append("")
    return out


def _ulysses_section(plot: Path) -> list[str]:
    """The sequence-parallel curves (`benchmarks/ulysses.py`); its figures are in the table above."""
    if not plot.exists():
        return []
    return [
        ULYSSES_HEADING,
        "",
        f"![ulysses]({plot.name})",
        "",
    ]


def _infinity_section(plot: Path) -> list[str]:
    """The per-phase bars of `benchmarks/infinity.py` (median step, forward / backward / optimizer)."""
    if not plot.exists():
        return []
    return [
        INFINITY_HEADING,
        "",
        "Median step by phase (ds updates each sub-group during backward, so its optimizer phase is empty; "
        "the NVMe traffic and CPU Adam per phase are in the raw output below).",
        "",
        f"![infinity]({plot.name})",
        "",
    ]


def _runs(runs: list[dict]) -> list[str]:
    out = [
        "## Runs",
        "",
        "Each benchmark's settings (arguments beyond `--json`; none = its defaults), wall time, "
        "the 1-minute load average at its start and end, and the cores other processes kept busy meanwhile.",
        "",
        "| benchmark | arguments | wall time | load start / end | other processes | status |",
        "| --- | --- | ---: | --- | ---: | --- |",
    ]
    for r in runs:
        args = " ".join("DIR" if a.startswith("/") else a for a in r["args"]) or "(defaults)"
        others = "" if r.get("others_cores") is None else f"{r['others_cores']:.2f} cores"
        out.append(
            f"| {r['benchmark']} | `{args}` | {r['seconds']:.0f} s | {r['load_before'][0]:.2f} / "
            f"{r['load_after'][0]:.2f} | {others} | {r['status']} |"
        )
    return out + [""]


def render(
    *,
    machine: dict[str, str],
    rows: list[Row],
    runs: list[dict],
    texts: dict[str, str],
    quick: bool,
    label: str,
    loads: tuple,
    total_s: float,
    plot: Path,
    command: str,
) -> str:
    """The whole RESULTS.md page."""
    out = _header(machine, loads, runs, quick, label, command, total_s)
    failed = [r for r in runs if r["status"] != "ok"]
    out += [
        "## Figures",
        "",
        "`ratio` = value / baseline value (for times, below 1 is faster than the baseline), except in a "
        "figure marked *paired*: there it is the median of per-round ratios, both sides timed within the "
        "same fraction of a second (values are then medians of each side). A target "
        "with a unit bounds the value; a bare number bounds the ratio (or the value when there is no "
        "baseline). Each benchmark's own printout (below) has more columns.",
        "",
    ]
    out += _table([r for r in rows if r.benchmark != "loss_curves"])
    for r in failed:
        out.append(f"| {r['benchmark']} | **{r['status']}**: no figures (output below) | | | | | | **no** |")
    out.append("")
    out += _loss_section(rows, plot)
    out += _ulysses_section(plot.parent / "ulysses.svg")
    out += _infinity_section(plot.parent / "infinity.svg")
    if runs:
        out += _runs(runs)
    if texts:
        out += ["## Raw output", ""]
        for name, text in texts.items():
            out += [f"<details><summary>{name}</summary>", "", "```", text.rstrip(), "```", "", "</details>", ""]
    return "\n".join(out)
