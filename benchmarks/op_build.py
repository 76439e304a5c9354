"""Cold JIT build time of cpu_adam (empty cache) and cached load time, each in a fresh process.

Each trial uses a new empty TORCH_EXTENSIONS_DIR: one fresh process builds (cold), then another
fresh process loads from that cache (cached); trials alternate cold and cached. A child reports
the time of `CPUAdamBuilder().load()` alone and of `import ds_ops` + load (torch is imported first
and not counted: every user of an optimizer has paid it already). Children may write bytecode and
one untimed child runs first, as after `pip install` (which compiles .pyc files); with
PYTHONDONTWRITEBYTECODE set, every `import ds_ops` would compile its sources. DeepSpeed's own cpu_adam took
about 90 s cold and 2.3 s cached on this class of machine.
Targets: cold <= 20 s, cached <= 0.1 s.

    python benchmarks/op_build.py [--trials 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import _report

DEEPSPEED_COLD_S, DEEPSPEED_CACHED_S = 90.0, 2.3

CHILD = """
import json, sys, time
t0 = time.perf_counter(); import torch; t1 = time.perf_counter()
import ds_ops; t2 = time.perf_counter()
builder = ds_ops.CPUAdamBuilder(); builder.load(); t3 = time.perf_counter()
print(json.dumps({"torch_import": t1 - t0, "import_ds_ops": t2 - t1, "load": t3 - t2,
                  "from": builder.loaded_from, "cpp_extension": "torch.utils.cpp_extension" in sys.modules}))
"""


def _child(cache: str) -> dict:
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=cache)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    result = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    _report.add_json_argument(parser)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"cold": [], "cached": []}
    with tempfile.TemporaryDirectory() as cache:
        _child(cache)  # untimed: writes the .pyc files an installed package has
    for _ in range(args.trials):
        with tempfile.TemporaryDirectory() as cache:
            runs["cold"].append(_child(cache))
            runs["cached"].append(_child(cache))
    assert all(r["from"] == "jit" for r in runs["cold"]) and all(r["from"] == "cache" for r in runs["cached"])
    assert not any(r["cpp_extension"] for r in runs["cold"] + runs["cached"])
    print(
        f"cpu_adam op, median of {args.trials} fresh processes each (torch import not counted: "
        f"median {statistics.median(r['torch_import'] for r in runs['cached']):.2f} s)"
    )
    header = f"{'':<8} {'load s':>8} {'import+load s':>14} {'DeepSpeed s':>12} {'DeepSpeed/ours':>15} {'target s':>9}"
    print(header)
    print("-" * len(header))
    rows = []
    for kind, reference, target in (("cold", DEEPSPEED_COLD_S, 20.0), ("cached", DEEPSPEED_CACHED_S, 0.1)):
        load = statistics.median(r["load"] for r in runs[kind])
        total = statistics.median(r["load"] + r["import_ds_ops"] for r in runs[kind])
        print(f"{kind:<8} {load:>8.3f} {total:>14.3f} {reference:>12.1f} {reference / total:>14.0f}x {target:>9}")
        rows.append(
            _report.Row(
                "op_build",
                f"cpu_adam {kind} import ds_ops + load, median of {args.trials}",
                total,
                "s",
                "DeepSpeed cpu_adam",
                reference,
                target=f"<= {target} s",
            )
        )
    _report.write_rows(args.json, rows)


if __name__ == "__main__":
    main()
