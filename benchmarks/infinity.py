"""ZeRO-Infinity past the machine's memory: a stack of Linear(8192, 8192) layers trained from NVMe, ds vs DeepSpeed.

    python benchmarks/infinity.py                       # 36 layers = 2.42B parameters (~31.5 GB of state)
    python benchmarks/infinity.py --layers 9            # 0.6B, where DeepSpeed 0.19.8 also runs here
    python benchmarks/infinity.py --layers 3 --check    # 0.2B: NVMe losses vs the same model without offload

Each side runs `_infinity_job.py` in its own process (one rank, stage 3, bf16, AdamW, parameters and
optimizer state on NVMe under `--nvme`, batch 4, the users' defaults: `bf16.check_grad_overflow` on and
`gradient_clipping` 0 unless `--no-overflow-check` / `--clip X`): ds with this interpreter, DeepSpeed 0.19.8 with
`--deepspeed-python` (default `$DS_REFERENCE_PYTHON`, else /work/dsref/bin/python) when its async_io op can be
built (it needs libaio: the benchmark tries `apt-get install libaio-dev` when it runs as root). Reported per
step (the median step after `--warmup`): time in forward, backward and the optimizer; for ds also the NVMe reads
and writes (bytes, busy seconds, GB/s), how much of the optimizer phase was CPU Adam and how much of it overlapped
I/O; peak RSS of the step; bytes on disk. The floor printed next to it is what the NVMe traffic alone
costs at the disk's measured bandwidth (`ds_io`, 1 GiB, before the runs): the optimizer state read and
written once, the bf16 parameters read twice and written once, less what the parameter swap buffers keep
between the passes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import _infinity_breakdown as breakdown
import _report
import _svg_bars

HERE = Path(__file__).resolve().parent


def _ensure_libaio() -> bool:
    """Whether libaio's header is present (installed with apt-get when we may)."""
    if Path("/usr/include/libaio.h").exists():
        return True
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return False
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "libaio-dev"]):
        if subprocess.run(cmd, capture_output=True, check=False).returncode != 0:
            return False
    return Path("/usr/include/libaio.h").exists()


def _deepspeed_ready(python: str) -> str:
    """Empty when DeepSpeed's async_io op is usable under `python`, else why not."""
    if not python or not Path(python).exists():
        return "no DeepSpeed interpreter (set DS_REFERENCE_PYTHON or --deepspeed-python)"
    if not _ensure_libaio():
        return "libaio-dev is missing and could not be installed"
    probe = "from deepspeed.ops.op_builder import AsyncIOBuilder as B; print(B().is_compatible(verbose=False))"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # ours would shadow the real package
    out = subprocess.run([python, "-c", probe], capture_output=True, text=True, check=False, env=env)
    if out.returncode != 0 or out.stdout.strip().splitlines()[-1:] != ["True"]:
        return "DeepSpeed's async_io op is not compatible here"
    return ""


def _disk_bandwidth(folder: Path) -> tuple[float, float, float]:
    """(read, write, both at once) GB/s of 1 GiB O_DIRECT transfers in `folder`: ds_io's read and write,
    then a read of one file while another is written (the two requests' bytes over the time both took)."""
    import time

    import torch

    from ds_ops.aio import AsyncIOHandle
    from ds_ops.nvme_bench import run_io

    folder.mkdir(parents=True, exist_ok=True)
    kw: dict[str, Any] = {"io_size": 1 << 30, "block_size": 8 << 20, "queue_depth": 32, "loops": 2}
    write = run_io(str(folder), read=False, **kw)
    read = run_io(str(folder), read=True, **kw)
    reader, writer = (AsyncIOHandle(8 << 20, 32, False, True, 2) for _ in range(2))
    src, dst = (h.new_cpu_locked_tensor(1 << 30, torch.empty(0, dtype=torch.uint8)) for h in (writer, reader))
    src.fill_(1)
    for name in ("a", "b"):
        writer.sync_pwrite(src, folder / name)
    best = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        writer.async_pwrite(src, folder / "a")
        reader.async_pread(dst, folder / "b")
        writer.wait()
        reader.wait()
        best = min(best, time.perf_counter() - start)
    return read.best_gbps, write.best_gbps, 2 * (1 << 30) / best / 1e9


def _run_side(side: str, python: str, args: argparse.Namespace, out: Path, offload: str = "nvme") -> dict[str, Any]:
    cmd = [
        python,
        str(HERE / "_infinity_job.py"),
        "--side",
        side,
        "--offload",
        offload,
        "--layers",
        str(args.layers),
        "--width",
        str(args.width),
        "--steps",
        str(args.warmup + args.steps),
        "--nvme",
        str(args.nvme / side),
        "--buffers",
        str(args.buffers),
        "--live",
        str(args.live),
        "--sub-group",
        str(args.sub_group),
        "--out",
        str(out),
        "--clip",
        str(args.clip),
        *(["--no-overflow-check"] if args.no_overflow_check else []),
    ]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    if side == "deepspeed":
        env.pop("PYTHONPATH", None)  # the reference venv has its own packages
    proc = subprocess.run(cmd, env=env, check=False, timeout=args.timeout)
    if proc.returncode != 0:
        return {"side": side, "error": f"exit status {proc.returncode} (see its output above)"}
    result = json.loads(out.read_text())
    shutil.rmtree(args.nvme / side, ignore_errors=True)
    return result


def _summary(result: dict[str, Any], warmup: int) -> dict[str, Any]:
    steps = [breakdown.step_breakdown(s) for s in result["steps"]]
    timed = steps[warmup:] or steps
    mid = sorted(timed, key=lambda s: s["total_s"])[len(timed) // 2]
    return {
        "median": mid,
        "peak_rss_gib": max(s["peak_rss_gib"] for s in steps),
        "step_s": [round(s["total_s"], 2) for s in steps],
        "losses": [s["loss"] for s in steps],
    }


def _print_side(name: str, result: dict[str, Any], s: dict[str, Any]) -> None:
    m = s["median"]
    print(
        f"\n{name}: {result['params'] / 1e9:.2f}B parameters, built in {result['build_s']:.0f} s, "
        f"{result['disk_bytes'] / 1e9:.1f} GB on disk; steps {s['step_s']} s; peak RSS {s['peak_rss_gib']:.2f} GiB"
    )
    print(f"  median step {m['total_s']:.2f} s:")
    for phase in ("forward", "backward", "optimizer"):
        row = m[phase]
        extra = ""
        if row.get("adam_s") and m["io_busy_s"] > 0:
            extra = f", CPU Adam {row['adam_s']:.2f} s (with I/O in flight {row['adam_with_io_s']:.2f} s)"
            if phase == "optimizer":
                extra += f", neither {row['idle_s']:.2f} s"
        io = f"NVMe busy {row['io_busy_s']:.2f} s (read {row['read_busy_s']:.2f}, write {row['write_busy_s']:.2f})"
        print(f"    {phase:<10}{row['s']:>7.2f} s  " + (io if m["io_busy_s"] > 0 else "") + extra)
    if m["io_busy_s"] > 0:
        rb, wb = m["read_bytes"], m["write_bytes"]
        print(
            f"  NVMe: read {rb / 1e9:.1f} GB in {m['read_busy_s']:.2f} s busy "
            f"({rb / 1e9 / max(m['read_busy_s'], 1e-9):.2f} GB/s), write {wb / 1e9:.1f} GB in "
            f"{m['write_busy_s']:.2f} s ({wb / 1e9 / max(m['write_busy_s'], 1e-9):.2f} GB/s), "
            f"both at once {m['read_and_write_s']:.2f} s; I/O busy {m['io_busy_s']:.2f} s of {m['total_s']:.2f} s"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=36, help="Linear layers (36: 2.42B, 9: 0.6B, 3: 0.2B)")
    parser.add_argument("--width", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=2, help="timed steps after the warm-up")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--buffers", type=int, default=16, help="offload_param.buffer_count")
    parser.add_argument("--live", type=int, default=200_000_000, help="stage3_max_live_parameters")
    parser.add_argument("--sub-group", type=int, default=100_000_000, help="sub_group_size")
    parser.add_argument("--nvme", type=Path, default=None, help="swap folder (default: a temporary one on /tmp)")
    parser.add_argument(
        "--sides",
        default=None,
        help="comma-separated: ds, deepspeed (default: both up to 12 layers; ds alone above, where DeepSpeed 0.19.8 "
        "runs out of buffers or memory on this 24 GB machine: pass ds,deepspeed to see it fail)",
    )
    parser.add_argument("--deepspeed-python", default=os.environ.get("DS_REFERENCE_PYTHON", "/work/dsref/bin/python"))
    parser.add_argument("--clip", type=float, default=0.0, help="gradient_clipping (DeepSpeed's default: 0)")
    parser.add_argument(
        "--no-overflow-check", action="store_true", help="bf16.check_grad_overflow false (default: on, DeepSpeed's)"
    )
    parser.add_argument("--check", action="store_true", help="also train without offload and compare the losses")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per side")
    parser.add_argument("--plot", type=Path, default=None, help="also write the per-phase bar chart (SVG) here")
    _report.add_json_argument(parser)
    args = parser.parse_args()
    if args.sides is None:
        args.sides = "ds,deepspeed" if args.layers <= 12 else "ds"
    tmp = Path(tempfile.mkdtemp(prefix="ds_infinity_"))
    args.nvme = args.nvme or tmp / "swap"
    read_gbps, write_gbps, both_gbps = _disk_bandwidth(args.nvme / "probe")
    shutil.rmtree(args.nvme / "probe", ignore_errors=True)
    print(
        f"disk under {args.nvme}: read {read_gbps:.2f} GB/s, write {write_gbps:.2f} GB/s, a read and a write at "
        f"once {both_gbps:.2f} GB/s in all (1 GiB each, O_DIRECT)"
    )
    results: dict[str, dict[str, Any]] = {}
    for side in args.sides.split(","):
        if side == "deepspeed":
            why = _deepspeed_ready(args.deepspeed_python)
            if why:
                print(f"\nDeepSpeed 0.19.8 skipped: {why}")
                continue
        python = sys.executable if side == "ds" else args.deepspeed_python
        results[side] = _run_side(side, python, args, tmp / f"{side}.json")
    summaries = {}
    for side, result in results.items():
        if "error" in result:
            print(f"\n{side}: failed, {result['error']}")
            continue
        summaries[side] = _summary(result, args.warmup)
        _print_side("ds" if side == "ds" else "DeepSpeed 0.19.8", result, summaries[side])
    rows: list[_report.Row] = []
    size = f"{args.layers}x{args.width}x{args.width}"
    if "ds" in summaries:
        ds = summaries["ds"]
        params = results["ds"]["params"]
        pool_bytes = args.buffers * args.width * args.width * 2  # offload_param's bf16 swap buffers
        floor = breakdown.floor_s(params, read_gbps, write_gbps, both_gbps, pool_bytes=pool_bytes)
        print(
            f"\nNVMe floor of one step ({params / 1e9:.2f}B): read {floor['read_bytes'] / 1e9:.1f} GB, write "
            f"{floor['write_bytes'] / 1e9:.1f} GB: {floor['overlapped_s']:.1f} s with reads and writes overlapped "
            f"at the disk's measured concurrent rate ({floor['ideal_s']:.1f} s if they added up), "
            f"{floor['serial_s']:.1f} s one after the other; ds median step {ds['median']['total_s']:.1f} s"
        )
        base = summaries.get("deepspeed")
        step_target = "<= 14 s" if args.layers >= 36 else ("<= 0.35" if base else "")  # the performance issue's
        rss_target = "<= 8 GiB" if args.layers >= 36 else ("<= 0.5" if base else "")
        rows += [
            _report.Row(
                "infinity",
                f"step time, {size} from NVMe",
                ds["median"]["total_s"],
                "s",
                "DeepSpeed 0.19.8",
                base["median"]["total_s"] if base else None,
                target=step_target,
            ),
            _report.Row(
                "infinity",
                f"peak RSS, {size} from NVMe",
                ds["peak_rss_gib"],
                "GiB",
                "DeepSpeed 0.19.8",
                base["peak_rss_gib"] if base else None,
                target=rss_target,
            ),
            _report.Row("infinity", f"NVMe floor of the step, {size}", floor["overlapped_s"], "s"),
        ]
        for phase in ("forward", "backward", "optimizer"):
            rows.append(
                _report.Row(
                    "infinity",
                    f"{phase} phase, {size}",
                    ds["median"][phase]["s"],
                    "s",
                    "DeepSpeed 0.19.8",
                    base["median"][phase]["s"] if base else None,
                )
            )
    if args.check:
        ref = _run_side("ds", sys.executable, args, tmp / "ref.json", offload="none")
        if "error" not in ref and "ds" in results and "error" not in results["ds"]:
            diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(results["ds"]["steps"], ref["steps"], strict=True)]
            print(
                f"\nlosses from NVMe {[s['loss'] for s in results['ds']['steps']]}\n"
                f"losses in memory {[s['loss'] for s in ref['steps']]}\nmax difference {max(diffs):.2e}"
            )
            rows.append(
                _report.Row("infinity", f"max |loss NVMe - loss in memory|, {size}", max(diffs), "", target="<= 1e-6")
            )
    if args.plot is not None and summaries:
        bars = [
            (
                f"{'ds' if side == 'ds' else 'DeepSpeed 0.19.8'} {results[side]['params'] / 1e9:.2f}B",
                [(phase, s["median"][phase]["s"]) for phase in ("forward", "backward", "optimizer")],
            )
            for side, s in summaries.items()
        ]
        args.plot.write_text(_svg_bars.render(bars, title=f"ZeRO-Infinity median step, {size}, by phase"))
        print(f"wrote {args.plot}")
    _report.write_rows(args.json, rows)
    shutil.rmtree(tmp, ignore_errors=True)
    if not summaries or any("error" in r for r in results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
