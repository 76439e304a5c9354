"""Cold JIT build time of cpu_adam (empty cache) and cached load time, each in a fresh process.

Each trial uses a new empty TORCH_EXTENSIONS_DIR: one fresh process builds (cold), then another
fresh process loads from that cache (cached); trials alternate cold and cached. A child reports
the time of `CPUAdamBuilder().load()` alone and of `import ds_ops` + load (torch is imported first
and not counted: every user of an optimizer has paid it already). Children may write bytecode and
one untimed child runs first, as after `pip install` (which compiles .pyc files); with
PYTHONDONTWRITEBYTECODE set, every `import ds_ops` would compile its sources.

The baseline is measured in the same run: DeepSpeed 0.19.8's own cpu_adam JIT build
(`from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()`, DS_ACCELERATOR=cpu)
in the venv given by `--deepspeed-python`, cold and cached the same way, the two sides alternating.
Besides wall time, each child's CPU time (its own and that of the compilers it waited for) is shown:
on a loaded host the wall figures stretch, the CPU figures much less.
Targets: cold <= 20 s, cached <= 0.1 s.

    python benchmarks/op_build.py [--trials 3] [--deepspeed-python /work/dsref/bin/python | none]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile

import _report

CHILD = """
import json, sys, time
t0 = time.perf_counter(); import torch; t1 = time.perf_counter()
import ds_ops; t2 = time.perf_counter()
builder = ds_ops.CPUAdamBuilder(); builder.load(); t3 = time.perf_counter()
print(json.dumps({"torch_import": t1 - t0, "import": t2 - t1, "load": t3 - t2,
                  "from": builder.loaded_from, "cpp_extension": "torch.utils.cpp_extension" in sys.modules}))
"""

# DeepSpeed 0.19.8's path to the same op: its builder JIT-compiles with torch's cpp_extension and ninja.
DEEPSPEED_CHILD = """
import json, time
t0 = time.perf_counter(); import torch; t1 = time.perf_counter()
from deepspeed.ops.op_builder import CPUAdamBuilder; t2 = time.perf_counter()
CPUAdamBuilder().load(); t3 = time.perf_counter()
print(json.dumps({"torch_import": t1 - t0, "import": t2 - t1, "load": t3 - t2}))
"""


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _child(cache: str, python: str = sys.executable, code: str = CHILD, *, deepspeed: bool = False) -> dict:
    """One fresh process loading cpu_adam with `cache` as TORCH_EXTENSIONS_DIR; its timings and CPU seconds."""
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=cache)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if deepspeed:  # DeepSpeed's venv alone: no ds sources on the path, its CPU accelerator
        env.pop("PYTHONPATH", None)
        env["DS_ACCELERATOR"] = "cpu"
    cpu_before = _children_cpu_s()
    result = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"op_build: {python} failed to load cpu_adam:\n{result.stderr[-3000:]}")
    timings = json.loads(result.stdout.strip().splitlines()[-1])
    timings["cpu"] = _children_cpu_s() - cpu_before
    return timings


def _trial(runs: dict[str, list[dict]], side: str, python: str, code: str) -> None:
    with tempfile.TemporaryDirectory() as cache:
        runs[f"{side} cold"].append(_child(cache, python, code, deepspeed=side == "deepspeed"))
        runs[f"{side} cached"].append(_child(cache, python, code, deepspeed=side == "deepspeed"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument(
        "--deepspeed-python",
        default="/work/dsref/bin/python",
        help="python of a deepspeed==0.19.8 venv for the baseline; 'none' (or a missing path) runs ds alone",
    )
    _report.add_json_argument(parser)
    args = parser.parse_args()
    baseline = args.deepspeed_python if os.path.exists(args.deepspeed_python) else None
    if baseline is None:
        print(f"no DeepSpeed venv at {args.deepspeed_python!r}: ds alone, no baseline column")
    runs: dict[str, list[dict]] = {f"{side} {kind}": [] for side in ("ds", "deepspeed") for kind in ("cold", "cached")}
    with tempfile.TemporaryDirectory() as cache:
        _child(cache)  # untimed: writes the .pyc files an installed package has
    for _ in range(args.trials):
        _trial(runs, "ds", sys.executable, CHILD)
        if baseline is not None:
            _trial(runs, "deepspeed", baseline, DEEPSPEED_CHILD)
    assert all(r["from"] == "jit" for r in runs["ds cold"]) and all(r["from"] == "cache" for r in runs["ds cached"])
    assert not any(r["cpp_extension"] for r in runs["ds cold"] + runs["ds cached"])
    print(
        f"cpu_adam op, median of {args.trials} fresh processes each, sides alternating (torch import not "
        f"counted: median {statistics.median(r['torch_import'] for r in runs['ds cached']):.2f} s)"
    )
    header = (
        f"{'':<8} {'import+load s':>14} {'CPU s':>8} {'DeepSpeed s':>12} {'DeepSpeed CPU s':>16} "
        f"{'DeepSpeed/ours':>15} {'target s':>9}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for kind, target in (("cold", 20.0), ("cached", 0.1)):
        total = statistics.median(r["load"] + r["import"] for r in runs[f"ds {kind}"])
        cpu = statistics.median(r["cpu"] for r in runs[f"ds {kind}"])
        theirs = runs[f"deepspeed {kind}"]
        reference = statistics.median(r["load"] + r["import"] for r in theirs) if theirs else None
        reference_cpu = statistics.median(r["cpu"] for r in theirs) if theirs else None
        shown = (
            f"{reference:>12.2f} {reference_cpu:>16.2f} {reference / total:>14.0f}x"
            if reference is not None and reference_cpu is not None
            else f"{'-':>12} {'-':>16} {'-':>15}"
        )
        print(f"{kind:<8} {total:>14.3f} {cpu:>8.2f} {shown} {target:>9}")
        rows.append(
            _report.Row(
                "op_build",
                f"cpu_adam {kind} import ds_ops + load, median of {args.trials}",
                total,
                "s",
                "DeepSpeed cpu_adam (same run)" if reference is not None else "",
                reference,
                target=f"<= {target} s",
            )
        )
        rows.append(
            _report.Row(
                "op_build",
                f"cpu_adam {kind} CPU time of the child with torch import and compilers, median of {args.trials}",
                cpu,
                "s",
                "DeepSpeed cpu_adam (same run)" if reference_cpu is not None else "",
                reference_cpu,
            )
        )
    _report.write_rows(args.json, rows)


if __name__ == "__main__":
    main()
