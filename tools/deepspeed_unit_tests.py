"""Run DeepSpeed's own CPU unit tests against ds, and against the real DeepSpeed, group by group.

    python tools/deepspeed_unit_tests.py --deepspeed-git /work/.mirror/deepspeedai+DeepSpeed/repo \
        --side deepspeed --out /tmp/dsunit/deepspeed.json
    python tools/deepspeed_unit_tests.py --deepspeed-git ... --side ds --out /tmp/dsunit/ds.json \
        --compare /tmp/dsunit/deepspeed.json

DeepSpeed's `tests/` tree is the acceptance measure for ds's public surface: a `deepspeed` that *is* ds should
pass what DeepSpeed itself passes on a CPU host. Nothing of DeepSpeed's is committed here: the tests are
exported from a checkout (a git directory) into a scratch folder that holds only `tests/`, so the `deepspeed`
its conftest imports is whichever the chosen venv has installed — ds's alias distribution built from this tree
(`--side ds`) or the pinned upstream release (`--side deepspeed`, built without ops). Both venvs get the same
pytest (DeepSpeed's tests need pytest < 8.4), and each group runs in its own pytest process with a per-test
timeout, its outcomes read from a JUnit XML report.

`--compare BASELINE` prints, per group, how many of the tests the baseline passed pass here, and lists every
one that does not with the first line of its failure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ROOT / "packages"
DEEPSPEED_PIN = "deepspeed==0.19.8"
PYTEST_PIN = ("pytest==8.3.5", "pytest-timeout==2.4.0")
# What DeepSpeed's tests import themselves (the CPU optimizer tests read the CPU's flags through cpuinfo).
TEST_REQUIREMENTS = ("transformers", "py-cpuinfo")
# The groups DeepSpeed's tests run on a CPU host (the rest need CUDA kernels, inference models or downloads).
GROUPS = (
    "launcher",
    "pipe",
    "runtime",
    "checkpoint",
    "ops",
    "utils",
    "comm",
    "monitor",
    "profiling",
    "sequence_parallelism",
    "ulysses_alst",
    "model_parallelism",
    "linear",
    "compile",
)


def export_tests(git_dir: Path, dest: Path) -> Path:
    """DeepSpeed's `tests/` (only that) from its git history, into `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(
        ["git", "--git-dir", str(git_dir), "archive", "HEAD", "tests"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "x", "-C", str(dest)], input=archive, check=True)
    return dest / "tests"


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    return env


def ensure_venv(venv: Path, side: str, reuse: bool = False) -> Path:
    """A venv with the chosen `deepspeed` and DeepSpeed's test requirements (created on first use).

    `reuse` takes an existing venv as it is: one where the ds packages were installed editable
    (`pip install -e packages/...`) follows the working tree without a reinstall per run.
    """
    python = venv / "bin" / "python"
    if reuse and python.exists():
        return python
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    constraints = ["-c", str(ROOT / "constraints.txt")]
    env = _clean_env()
    if side == "ds":
        sources = [str(p) for p in sorted(PACKAGES.iterdir()) if (p / "pyproject.toml").exists()]
        subprocess.run([*pip, *constraints, "torch", *TEST_REQUIREMENTS, *sources], check=True, env=env)
    else:
        env["DS_BUILD_OPS"] = "0"
        subprocess.run([*pip, *constraints, "torch", *TEST_REQUIREMENTS, DEEPSPEED_PIN], check=True, env=env)
    subprocess.run([*pip, *PYTEST_PIN], check=True, env=env)
    return python


def run_group(python: Path, tests: Path, group: str, report: Path, timeout_s: int, exclude: str = "") -> None:
    """One pytest process for `unit/<group>`; outcomes land in `report` (JUnit XML).

    A group may be a sub-path (`runtime/zero`, `runtime/test_ds_config_dict.py`): a big group then runs in
    pieces, each with its own report under the same folder layout. `exclude` is a pytest `-k` expression of
    tests left out on both sides (they are then absent from the report, not failures).
    """
    report.parent.mkdir(parents=True, exist_ok=True)
    command = [
        str(python),
        "-m",
        "pytest",
        f"unit/{group}",
        "-q",
        "-p",
        "no:cacheprovider",
        "--continue-on-collection-errors",
        f"--timeout={timeout_s}",
        f"--junitxml={report}",
        *(["-k", f"not ({exclude})"] if exclude else []),
    ]
    env = _clean_env()
    # As an activated venv: the launcher tests run the `deepspeed` console script by name.
    env["PATH"] = f"{python.parent}{os.pathsep}{env.get('PATH', '')}"
    with open(report.with_suffix(".log"), "w") as log:
        subprocess.run(command, cwd=tests, env=env, stdout=log, stderr=subprocess.STDOUT)


def read_outcomes(report: Path) -> dict[str, dict[str, str]]:
    """test id -> {"outcome": passed|failed|error|skipped, "message": first line of the reason}."""
    outcomes: dict[str, dict[str, str]] = {}
    if not report.exists():
        return outcomes
    for case in ET.parse(report).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                message = (child.get("message") or child.text or "").strip().splitlines()[:1]
                message = message[0][:200] if message else ""
                break
        outcomes[test_id] = {"outcome": outcome, "message": message}
    return outcomes


def compare(current: dict[str, dict[str, dict[str, str]]], baseline: dict[str, dict[str, dict[str, str]]]) -> str:
    """Per group: of the baseline's passes, how many pass here; then every one that does not."""
    lines = [f"{'group':<22}{'baseline passed':>16}{'ds passed':>11}{'share':>8}"]
    missing: list[str] = []
    total_base = total_here = 0
    for group in sorted(baseline):
        passed = [t for t, r in baseline[group].items() if r["outcome"] == "passed"]
        here = current.get(group, {})
        ok = [t for t in passed if here.get(t, {}).get("outcome") == "passed"]
        total_base, total_here = total_base + len(passed), total_here + len(ok)
        share = f"{len(ok) / len(passed):.0%}" if passed else "-"
        lines.append(f"{group:<22}{len(passed):>16}{len(ok):>11}{share:>8}")
        for test in passed:
            if test not in ok:
                result = here.get(test, {"outcome": "not collected", "message": ""})
                missing.append(f"  {test}: {result['outcome']} {result['message']}")
    share = f"{total_here / total_base:.0%}" if total_base else "-"
    lines.append(f"{'all':<22}{total_base:>16}{total_here:>11}{share:>8}")
    return "\n".join(lines + ["", "Passed by the baseline, not here:", *missing])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deepspeed-git", type=Path, required=True, help="a DeepSpeed git directory")
    parser.add_argument("--side", choices=("ds", "deepspeed"), required=True)
    parser.add_argument("--venv", type=Path, help="default: /tmp/dsunit/venv-<side>")
    parser.add_argument("--work", type=Path, default=Path("/tmp/dsunit"))
    parser.add_argument(
        "--groups", default=",".join(GROUPS), help="comma-separated; a group may be a sub-path such as runtime/zero"
    )
    parser.add_argument("--timeout", type=int, default=120, help="seconds per test")
    parser.add_argument(
        "--exclude",
        default="GPUError",
        help="pytest -k expression of tests to leave out on both sides (default: the *GPUError tests, which "
        "check an error on GPU tensors; on a CPU host with LOCAL_SIZE set they wedge DeepSpeed's harness: "
        "pytest.fail in a pool worker never returns); '' keeps everything",
    )
    parser.add_argument("--out", type=Path, required=True, help="outcomes as JSON")
    parser.add_argument("--compare", type=Path, help="a JSON written by another run")
    parser.add_argument("--reuse-venv", action="store_true", help="use an existing venv as it is, no install")
    parser.add_argument(
        "--local-size",
        type=int,
        help="export LOCAL_SIZE=N: DeepSpeed's CPU accelerator then counts N devices, so its harness runs tests "
        "of up to N ranks (unset it counts NUMA nodes, and a one-node host skips every multi-rank test)",
    )
    args = parser.parse_args()
    if args.local_size:
        os.environ["LOCAL_SIZE"] = str(args.local_size)

    python = ensure_venv(args.venv or args.work / f"venv-{args.side}", args.side, args.reuse_venv)
    tests = export_tests(args.deepspeed_git, args.work / f"tree-{args.side}")
    reports = args.work / f"reports-{args.side}"
    reports.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, dict[str, str]]] = {}
    for group in args.groups.split(","):
        if not (tests / "unit" / group).exists():
            print(f"{group}: not in this DeepSpeed checkout's tests/unit", file=sys.stderr)
            continue
        report = reports / f"{group}.xml"
        report.unlink(missing_ok=True)
        run_group(python, tests, group, report, args.timeout, args.exclude)
        results[group] = read_outcomes(report)
        counts: dict[str, int] = {}
        for result in results[group].values():
            counts[result["outcome"]] = counts.get(result["outcome"], 0) + 1
        print(f"{group}: {counts}", flush=True)
    args.out.write_text(json.dumps(results, indent=1, sort_keys=True))
    if args.compare:
        print(compare(results, json.loads(args.compare.read_text())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
