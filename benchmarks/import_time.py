"""Import cost of each ds package beyond `import torch`, in fresh interpreters (median of N runs).

Run: python benchmarks/import_time.py [--runs 5]. Target: < 0.05 s each (it was 0.3 s while the packages
imported their engines eagerly), and no CUDA initialisation.
"""

from __future__ import annotations

import argparse
import statistics

import _report

from ds_comm.testing import import_side_effects

MODULES = ("ds_comm", "ds_ops", "ds_zero", "ds_pipe", "ds_engine", "ds_launcher")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    _report.add_json_argument(parser)
    args = parser.parse_args()
    rows, any_cuda = [], False
    print(f"{'package':<14}{'median s':>10}{'max s':>8}{'cuda init':>11}  target < 0.05 s")
    for module in MODULES:
        reports = [import_side_effects(module) for _ in range(args.runs)]
        times = [r["seconds"] for r in reports]
        cuda = any(r["cuda_initialized"] for r in reports)
        print(f"{module:<14}{statistics.median(times):>10.3f}{max(times):>8.3f}{str(cuda):>11}")
        any_cuda |= cuda
        rows.append(
            _report.Row(
                "import_time",
                f"import {module} beyond torch, median of {args.runs}",
                statistics.median(times),
                "s",
                target="< 0.05 s",
            )
        )
    rows.append(_report.Row("import_time", "imports that initialised CUDA", float(any_cuda), "", target="== 0"))
    _report.write_rows(args.json, rows)


if __name__ == "__main__":
    main()
