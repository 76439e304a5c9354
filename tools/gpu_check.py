#!/usr/bin/env python3
"""One-call check of ds's CUDA paths on a GPU machine: install, build the ops, run every tests/cuda, benchmark.

    bash tools/gpu_check.sh                 # on the GPU machine: everything, within --budget-s (570 s)
    bash tools/gpu_check.sh --dry-run       # anywhere: install, import, collect the CUDA tests, print the plan
    DS_GPU_CHECK_CPU=1 bash tools/gpu_check.sh   # no GPU: every step on CPU, the benchmark with a tiny model
    python tools/gpu_check.py --fetch-wheels     # where an index is reachable: wheels the GPU image lacks

Steps, in order, each in its own process with its own time budget (a step that overruns is killed
and recorded as "timeout"; the rest still run): `env` (interpreter, torch, GPU, nvcc, and every
requirement the packages declare, met from what is installed or from carried wheels), `deps`
(install the carried wheels that are needed), `install` (`pip install --no-deps
--no-build-isolation --target` of every in-tree package: the interpreter's own torch is used and
nothing is resolved), `import` (each package imports from that target), `build_ops` (each ds-ops op
built with its time), `test:<dist>` (every `packages/<dist>/tests/cuda`, with a JUnit report), and
`bench` (`benchmarks/gpu.py`, given what is left of the budget).

Results go to `$OUT` (default `./gpu_out`): `gpu_check.log` (everything printed) and
`gpu_check.json` (each step's status, seconds and figures; rewritten after every step, so a run cut
short still leaves what it finished). Exit status 0 only when every step passed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import _gpu_check_deps as deps

ROOT = Path(__file__).resolve().parent.parent
CPU_ENV = "DS_GPU_CHECK_CPU"

#: Seconds each step may take before it is killed (the benchmark gets what is left of the budget).
BUDGETS = {
    "env": 60,
    "deps": 60,
    "install": 120,
    "import": 60,
    "build_ops": 180,
    "collect": 60,
    "test": 150,
    "plan": 60,
}
#: Test budgets where a package's CUDA tests need more than `BUDGETS["test"]`.
TEST_BUDGETS = {"ds-engine": 240, "ds-ops": 180}
#: What the benchmark needs at least; steps before it are cut short to leave this much.
BENCH_RESERVE_S = 150


@dataclass
class StepResult:
    name: str
    status: str = "pending"
    """ok, failed, timeout, skipped."""
    seconds: float = 0.0
    command: list[str] = field(default_factory=list)
    detail: dict[str, Any] = field(default_factory=dict)


class Check:
    """Runs the steps, tees their output into the log and keeps `gpu_check.json` up to date."""

    def __init__(self, out: Path, work: Path, budget_s: float, mode: str, reserve_s: float) -> None:
        self.out, self.work, self.mode = out, work, mode
        self.reserve = reserve_s
        """Seconds kept free for the benchmark when the steps before it are given their limits."""
        self.started = time.monotonic()
        self.deadline = self.started + budget_s
        self.results: list[StepResult] = []
        self.summary: dict[str, Any] = {
            "mode": mode,
            "budget_s": budget_s,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        out.mkdir(parents=True, exist_ok=True)
        self.log = (out / "gpu_check.log").open("w")
        self.site, self.deps_dir = work / "site", work / "deps"
        self.env = self._child_env()

    def _child_env(self) -> dict[str, str]:
        env = dict(os.environ)
        inherited = env.get("PYTHONPATH")
        env["PYTHONPATH"] = os.pathsep.join([str(self.site), str(self.deps_dir), *([inherited] if inherited else [])])
        env["TORCH_EXTENSIONS_DIR"] = str(self.work / "torch_extensions")
        env["DS_OPS_TEST_EXTENSIONS_DIR"] = env["TORCH_EXTENSIONS_DIR"]  # ds-ops' tests reuse build_ops' builds
        env["PYTHONUNBUFFERED"] = "1"
        env["PIP_ROOT_USER_ACTION"] = "ignore"  # the GPU machine runs commands as root
        env["PYTHONWARNINGS"] = "ignore::FutureWarning:torch.distributed.c10d_logger"
        for name in [k for k in env if k == "DS_BUILD_OPS" or k.startswith("DS_BUILD_")]:
            del env[name]  # the install must stay pure Python: ops are built, and timed, in build_ops
        return env

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")
        self.log.flush()

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def write_json(self) -> None:
        self.summary["elapsed_s"] = round(time.monotonic() - self.started, 1)
        self.summary["steps"] = [asdict(r) for r in self.results]
        self.summary["ok"] = all(r.status in ("ok", "skipped") for r in self.results)
        path = self.out / "gpu_check.json"
        path.with_suffix(".tmp").write_text(json.dumps(self.summary, indent=1, default=str) + "\n")
        os.replace(path.with_suffix(".tmp"), path)

    def record(self, result: StepResult) -> StepResult:
        self.results.append(result)
        self.say(f"=== {result.name}: {result.status} in {result.seconds:.1f} s")
        self.write_json()
        return result

    def run(
        self, name: str, cmd: list[str], budget_s: float, *, reserve_s: float = 0.0, env: dict[str, str] | None = None
    ) -> StepResult:
        """Run `cmd` in its own process group, killed after `budget_s` (clipped to leave `reserve_s`)."""
        limit = min(budget_s, self.remaining() - reserve_s)
        result = StepResult(name, command=cmd)
        if limit < 5:
            result.status, result.detail["reason"] = "skipped", f"no time left in the budget ({limit:.0f} s)"
            return self.record(result)
        shown = " ".join("<code>" if "\n" in arg else arg for arg in cmd)
        self.say(f"\n=== {name} (limit {limit:.0f} s): {shown}")
        started = time.monotonic()
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env or self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            errors="replace",
            start_new_session=True,
        )
        tail: list[str] = []

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                self.say(f"[{name}] {line.rstrip()}")
                tail.append(line.rstrip())
                del tail[:-15]

        # Read in a thread and wait here: a grandchild that left the group could hold the pipe open
        # after the kill, and the step must still end at its limit.
        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        timed_out = False
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc.pid)
            rc = proc.wait()
        finally:
            _kill_group(proc.pid)  # whatever it left behind in its group
        reader.join(timeout=10)
        result.seconds = round(time.monotonic() - started, 2)
        result.status = "timeout" if timed_out else ("ok" if rc == 0 else "failed")
        result.detail["rc"] = rc
        if result.status != "ok":
            result.detail["tail"] = tail
        return self.record(result)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# -- steps ------------------------------------------------------------------------------------------------
def _cmd_output(cmd: list[str]) -> str | None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return (done.stdout or done.stderr).strip() or None


def step_env(check: Check, wheels_dir: Path) -> deps.Resolution | None:
    """Interpreter, torch, GPU and toolchain, and whether every requirement can be met (from wheels if need be)."""
    started = time.monotonic()
    result = StepResult("env")
    probe = (
        "import json, torch; c = torch.cuda.is_available(); print(json.dumps({'torch': torch.__version__, "
        "'torch_cuda': torch.version.cuda, 'cuda_available': c, 'device': torch.cuda.get_device_name(0) if c "
        "else None, 'capability': torch.cuda.get_device_capability(0) if c else None, 'memory_gib': "
        "round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if c else None}))"
    )
    info = _cmd_output([sys.executable, "-c", probe])
    detail: dict[str, Any] = {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "nvcc": _cmd_output(["nvcc", "--version"]),
        "nvidia_smi": _cmd_output(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
        ),
        "work_filesystem": _cmd_output(["df", "-hT", str(check.work)]),
    }
    try:
        detail.update(json.loads((info or "").splitlines()[-1]))
    except (ValueError, IndexError):
        detail["torch_error"] = info
    needs = deps.declared_needs(ROOT)
    resolution = deps.resolve(needs.all(), deps.carried_wheels(wheels_dir))
    detail["requirements"] = {
        "present": resolution.present,
        "from_wheels": {k: w.path.name for k, w in resolution.carried.items()},
        "missing": resolution.missing,
    }
    result.detail, result.seconds = detail, round(time.monotonic() - started, 2)
    for key in ("python", "executable", "torch", "torch_cuda", "cuda_available", "device", "memory_gib", "nvidia_smi"):
        check.say(f"[env] {key}: {detail.get(key)}")
    for req, version in resolution.present.items():
        check.say(f"[env] {req}: installed {version}")
    for key, wheel in resolution.carried.items():
        check.say(f"[env] {key}: from carried wheel {wheel.path.name}")
    problems = []
    if resolution.missing:
        problems.append(resolution.message())
    if "torch" not in detail:
        problems.append(f"torch does not import here: {info}")
    elif not detail["cuda_available"] and check.mode == "gpu":
        problems.append(
            f"torch sees no CUDA device (torch {detail['torch']}, CUDA {detail['torch_cuda']}); run "
            f"with --dry-run for the CPU check, or {CPU_ENV}=1 to run every step on CPU"
        )
    for problem in problems:
        check.say(f"[env] ERROR: {problem}")
    result.status = "failed" if problems else "ok"
    check.summary["environment"] = {k: v for k, v in detail.items() if k != "requirements"}
    check.record(result)
    return None if problems else resolution


def step_deps(check: Check, resolution: deps.Resolution) -> bool:
    shutil.rmtree(check.deps_dir, ignore_errors=True)
    check.deps_dir.mkdir(parents=True)
    if not resolution.carried:
        result = StepResult("deps", status="ok", detail={"installed": []})
        return check.record(result).status == "ok"
    wheels = list(resolution.carried.values())
    result = check.run("deps", deps.install_wheels(wheels, check.deps_dir), BUDGETS["deps"])
    result.detail["installed"] = [w.path.name for w in wheels]
    return result.status == "ok"


def step_install(check: Check) -> bool:
    shutil.rmtree(check.site, ignore_errors=True)
    dirs = deps.package_dirs(ROOT)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "--disable-pip-version-check",
        "--no-compile",
        "--target",
        str(check.site),
        *(str(d.relative_to(ROOT)) for d in dirs),
    ]
    result = check.run("install", cmd, BUDGETS["install"], reserve_s=check.reserve)
    result.detail["packages"] = [deps.dist_name(d) for d in dirs]
    return result.status == "ok"


def step_import(check: Check) -> bool:
    modules = [deps.dist_name(d).replace("-", "_") for d in deps.package_dirs(ROOT)]
    code = (
        "import importlib, json, sys\nfrom pathlib import Path\nsite = Path(sys.argv[1]).resolve()\n"
        "found = {}\nfor name in sys.argv[2:]:\n    mod = importlib.import_module(name)\n"
        "    where = Path(mod.__file__).resolve()\n    assert site in where.parents, f'{name} imported from "
        "{where}, not from {site}'\n    found[name] = getattr(mod, '__version__', '?')\n"
        "    print(name, found[name], where)\nprint('IMPORTED', json.dumps(found))\n"
    )
    result = check.run(
        "import", [sys.executable, "-c", code, str(check.site), *modules], BUDGETS["import"], reserve_s=check.reserve
    )
    return result.status == "ok"


def step_build_ops(check: Check, require_cuda: bool) -> None:
    report = check.work / "build_ops.json"
    report.unlink(missing_ok=True)
    shutil.rmtree(check.env["TORCH_EXTENSIONS_DIR"], ignore_errors=True)  # timed from scratch, every run
    cmd = [sys.executable, str(ROOT / "tools" / "_gpu_check_ops.py"), "--json", str(report)]
    result = check.run(
        "build_ops", cmd + (["--require-cuda"] if require_cuda else []), BUDGETS["build_ops"], reserve_s=check.reserve
    )
    if report.exists():
        result.detail["ops"] = json.loads(report.read_text())
        check.write_json()


def cuda_test_dirs() -> list[Path]:
    return [d / "tests" / "cuda" for d in deps.package_dirs(ROOT) if (d / "tests" / "cuda").is_dir()]


def _junit(path: Path) -> dict[str, Any]:
    """Counts and one row per test case from a pytest JUnit XML report."""
    root = ET.parse(path).getroot()
    cases = []
    for case in root.iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                message = (child.get("message") or "").splitlines()[0][:300] if child.get("message") else ""
                break
        cases.append(
            {
                "test": f"{case.get('classname')}::{case.get('name')}",
                "outcome": outcome,
                "seconds": round(float(case.get("time") or 0), 2),
                "message": message,
            }
        )
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
    return {"counts": counts, "cases": cases}


def step_tests(check: Check, collect_only: bool) -> None:
    for test_dir in cuda_test_dirs():
        dist = test_dir.parent.parent.name
        rel = str(test_dir.relative_to(ROOT))
        junit = check.work / f"junit-{dist}.xml"
        junit.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "pytest", rel, "-p", "no:cacheprovider", "-q"]
        if collect_only:
            result = check.run(f"collect:{dist}", [*cmd, "--collect-only"], BUDGETS["collect"], reserve_s=check.reserve)
        else:
            cmd += ["-rfEsx", "--durations=10", f"--junitxml={junit}"]
            result = check.run(f"test:{dist}", cmd, TEST_BUDGETS.get(dist, BUDGETS["test"]), reserve_s=check.reserve)
            if junit.exists():
                result.detail.update(_junit(junit))
                check.write_json()
        if collect_only and result.status == "ok":
            result.detail["collected"] = sum(1 for line in _collected_lines(check, result.name))
            check.write_json()


def _collected_lines(check: Check, step: str) -> list[str]:
    """Test ids the step printed (`--collect-only -q` prints one `path::name` line per test)."""
    text = (check.out / "gpu_check.log").read_text()
    prefix = f"[{step}] "
    return [line for line in text.splitlines() if line.startswith(prefix) and "::" in line]


def step_bench(check: Check, plan_only: bool, quick: bool, cpu: bool, only: str = "") -> None:
    script = str(ROOT / "benchmarks" / "gpu.py")
    details = check.work / "bench.json"
    details.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        script,
        *(["--quick"] if quick else []),
        *(["--cpu-smoke"] if cpu else []),
        *(["--only", only] if only else []),
    ]
    if plan_only:
        check.run("plan", [*cmd, "--plan"], BUDGETS["plan"])
        return
    deadline = max(0.0, check.remaining() - 10)
    cmd += [
        "--deadline-s",
        f"{deadline:.0f}",
        "--details",
        str(details),
        "--json",
        str(check.work / "bench_rows.json"),
        "--work",
        str(check.work / "bench"),
    ]
    result = check.run("bench", cmd, deadline + 5)
    if details.exists():
        result.detail.update(json.loads(details.read_text()))
        check.write_json()


# -- main -------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="install, import, collect the CUDA tests and print the benchmark plan (no GPU needed)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ.get("OUT") or ROOT / "gpu_out"),
        help="where gpu_check.log and gpu_check.json go (default $OUT, else ./gpu_out)",
    )
    # On the checkout's disk rather than /tmp, which may be memory-backed: the NVMe swap files go here.
    parser.add_argument(
        "--work",
        type=Path,
        default=ROOT / "build" / "gpu_check",
        help="the private install target, build caches and NVMe swap files (default build/gpu_check)",
    )
    parser.add_argument(
        "--wheels",
        type=Path,
        default=ROOT / ".gpu_wheels",
        help="carried wheels for requirements the interpreter lacks (default .gpu_wheels)",
    )
    parser.add_argument("--budget-s", type=float, default=570, help="wall-clock budget of the whole check")
    parser.add_argument("--full-bench", action="store_true", help="the benchmark's full plan instead of --quick")
    parser.add_argument("--skip", default="", help="comma-separated steps to leave out: build_ops, tests, bench")
    parser.add_argument("--bench-only", default="", help="passed to benchmarks/gpu.py --only (a rerun of some figures)")
    parser.add_argument(
        "--fetch-wheels",
        action="store_true",
        help="only download the wheels the GPU image lacks into --wheels, then exit",
    )
    parser.add_argument("--python-version", default="3.12", help="with --fetch-wheels: the GPU machine's Python")
    parser.add_argument(
        "--print-requirements",
        action="store_true",
        help="only print what the packages, their builds and the CUDA tests need, one per line",
    )
    args = parser.parse_args(argv)
    if args.print_requirements:
        print("\n".join(deps.declared_needs(ROOT).all()))
        return 0
    if args.fetch_wheels:
        return deps.fetch_wheels(args.wheels, args.python_version)
    cpu = os.environ.get(CPU_ENV, "") not in ("", "0")
    mode = "dry-run" if args.dry_run else ("cpu" if cpu else "gpu")
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    unknown = skip - {"build_ops", "tests", "bench"}
    if unknown:
        parser.error(f"--skip: unknown step(s) {', '.join(sorted(unknown))}; choose from build_ops, tests, bench")
    if args.work.resolve() in (ROOT, *ROOT.parents):
        parser.error(f"--work {args.work} would empty the checkout or a folder above it; name a scratch folder")
    args.work.mkdir(parents=True, exist_ok=True)
    check = Check(
        args.out.resolve(),
        args.work.resolve(),
        args.budget_s,
        mode,
        reserve_s=0.0 if args.dry_run or "bench" in skip else BENCH_RESERVE_S,
    )
    check.say(f"ds GPU check ({mode}): out {check.out}, work {check.work}, budget {args.budget_s:.0f} s")
    resolution = step_env(check, args.wheels.resolve())
    ready = resolution is not None and step_deps(check, resolution) and step_install(check) and step_import(check)
    if ready:
        if args.dry_run:
            step_tests(check, collect_only=True)
            step_bench(check, plan_only=True, quick=not args.full_bench, cpu=False, only=args.bench_only)
        else:
            if "build_ops" not in skip:
                step_build_ops(check, require_cuda=mode == "gpu")
            if "tests" not in skip:
                step_tests(check, collect_only=False)
            if "bench" not in skip:
                step_bench(check, plan_only=False, quick=not args.full_bench, cpu=cpu, only=args.bench_only)
    check.write_json()
    _print_summary(check)
    return 0 if ready and check.summary["ok"] else 1


def _print_summary(check: Check) -> None:
    check.say("\n=== summary")
    for r in check.results:
        extra = ""
        if "counts" in r.detail:
            extra = " " + " ".join(f"{k}={v}" for k, v in r.detail["counts"].items() if v)
        elif "collected" in r.detail:
            extra = f" collected={r.detail['collected']}"
        check.say(f"  {r.name:<20} {r.status:<8} {r.seconds:7.1f} s{extra}")
    for r in check.results:
        for line in r.detail.get("table", []):
            check.say(line)
    check.say(f"  total {time.monotonic() - check.started:.0f} s; figures in {check.out / 'gpu_check.json'}")


if __name__ == "__main__":
    sys.exit(main())
