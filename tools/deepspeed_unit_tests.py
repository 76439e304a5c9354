"""Run DeepSpeed's own unit tests against ds, and against the real DeepSpeed, group by group.

    python tools/deepspeed_unit_tests.py --deepspeed-git /work/.mirror/deepspeedai+DeepSpeed/repo \
        --side deepspeed --out /tmp/dsunit/deepspeed.json
    python tools/deepspeed_unit_tests.py --deepspeed-git ... --side ds --out /tmp/dsunit/ds.json \
        --compare /tmp/dsunit/deepspeed.json --markdown /tmp/dsunit/table.md

DeepSpeed's `tests/` tree is the acceptance measure for ds's public surface: a `deepspeed` that *is* ds should
pass what DeepSpeed itself passes on a CPU host. Nothing of DeepSpeed's is committed here: the tests are
exported from a checkout (a git directory) into a scratch folder that holds only `tests/`, so the `deepspeed`
its conftest imports is whichever the chosen venv has installed: ds's alias distribution built from this tree
(`--side ds`) or the pinned upstream release (`--side deepspeed`, built without ops). Both venvs get the same
pytest (DeepSpeed's tests need pytest < 8.4).

The groups are the folders of the exported `tests/unit` that hold tests (`--groups` picks some, or sub-paths
such as `v1/zero`). Each group runs in a pytest process of its own, supervised: every test gets `--timeout`
seconds, enforced inside pytest and, for a test that wedges its process, from outside (the test is recorded as
`timeout` and the group goes on; see tools/_dsunit_run.py). Hugging Face downloads are off (offline mode), the
same on both sides.

`--compare BASELINE` prints, per group, how many of the tests the baseline passed pass here, and lists every
one that does not with the first line of its failure; `--markdown FILE` writes the same counts as a table for
benchmarks/RESULTS.md (group | DeepSpeed passes | ds passes | share), with the baseline as DeepSpeed's side.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _dsunit_report import compare, counts, markdown_table  # noqa: E402 - tools/ is a script folder
from _dsunit_run import run_group  # noqa: E402

logger = logging.getLogger("deepspeed_unit_tests")

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ROOT / "packages"
DEEPSPEED_PIN = "deepspeed==0.19.8"
PYTEST_PIN = ("pytest==8.3.5", "pytest-timeout==2.4.0")
# What DeepSpeed's tests import themselves (the CPU optimizer tests read the CPU's flags through cpuinfo).
TEST_REQUIREMENTS = ("transformers", "py-cpuinfo")


# JIT-built ops nearly every test loads (DeepSpeed's CPU comm; the Adam most configs name, which DeepSpeed
# builds as FusedAdam on a CPU host too), built once before the tests so a build never counts against a test's
# time limit (each takes minutes, tens of minutes on a loaded host) nor is killed half done.
PREBUILD_OPS = ("ShareMemCommBuilder", "CPUAdamBuilder", "FusedAdamBuilder")
_PREBUILD = """
import sys, time
import deepspeed.ops.op_builder as builders
from deepspeed.accelerator import get_accelerator
for name in sys.argv[1:]:
    start = time.time()
    try:
        make = getattr(get_accelerator(), "create_op_builder", None)
        builder = make(name) if make is not None else getattr(builders, name, lambda: None)()
        if builder is None:
            print(f"{name}: not in this deepspeed", flush=True)
            continue
        builder.load()
        print(f"{name}: built in {time.time() - start:.0f}s", flush=True)
    except Exception as exc:
        print(f"{name}: not built ({type(exc).__name__}: {exc})", flush=True)
"""


def prebuild_ops(python: Path, env: dict[str, str], names: tuple[str, ...] = PREBUILD_OPS) -> None:
    """Build (or find) the JIT ops in `names` in the run's extensions folder, with no time limit."""
    result = subprocess.run(
        [str(python), "-c", _PREBUILD, *names], env=env, capture_output=True, text=True, check=False
    )
    for line in result.stdout.splitlines():
        logger.info("prebuild %s", line)
    if result.returncode:
        logger.warning("prebuild exited with %d: %s", result.returncode, result.stderr.strip()[-500:])


def discover_groups(unit: Path) -> list[str]:
    """The folders of `tests/unit` that hold test modules (`test_*.py` at any depth), sorted."""
    return sorted(
        d.name for d in unit.iterdir() if d.is_dir() and d.name != "__pycache__" and any(d.rglob("test_*.py"))
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
    # No downloads on either side: a test that needs a model from the hub fails at once instead of waiting.
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deepspeed-git", type=Path, required=True, help="a DeepSpeed git directory")
    parser.add_argument("--side", choices=("ds", "deepspeed"), required=True)
    parser.add_argument("--venv", type=Path, help="default: /tmp/dsunit/venv-<side>")
    parser.add_argument("--work", type=Path, default=Path("/tmp/dsunit"))
    parser.add_argument(
        "--groups",
        default="",
        help="comma-separated (default: every folder of tests/unit that holds tests); a group may be a sub-path "
        "such as runtime/zero, v1/zero/test_zero.py or a node id (file.py::TestClass)",
    )
    parser.add_argument("--skip-groups", default="", help="comma-separated groups to leave out")
    parser.add_argument("--timeout", type=int, default=120, help="seconds per test")
    parser.add_argument(
        "--grace", type=int, default=60, help="seconds past --timeout before a wedged test is killed from outside"
    )
    parser.add_argument(
        "--exclude",
        default="GPUError",
        help="pytest -k expression of tests to leave out on both sides (default: the *GPUError tests, which "
        "check an error on GPU tensors; on a CPU host with LOCAL_SIZE set they wedge DeepSpeed's harness, so "
        "each would cost --timeout + --grace as a timeout); '' keeps everything",
    )
    parser.add_argument("--out", type=Path, required=True, help="outcomes as JSON")
    parser.add_argument("--compare", type=Path, help="a JSON written by another run")
    parser.add_argument(
        "--markdown", type=Path, help="with --compare: write the per-group table (the baseline as DeepSpeed's side)"
    )
    parser.add_argument("--reuse-venv", action="store_true", help="use an existing venv as it is, no install")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the results an interrupted run left in --work and run only the tests without one "
        "(tests it timed out or that crashed run again)",
    )
    parser.add_argument(
        "--no-prebuild", action="store_true", help=f"skip building {', '.join(PREBUILD_OPS)} before the tests"
    )
    parser.add_argument(
        "--local-size",
        type=int,
        help="export LOCAL_SIZE=N: DeepSpeed's CPU accelerator then counts N devices, so its harness runs tests "
        "of up to N ranks (unset it counts NUMA nodes, and a one-node host skips every multi-rank test)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.markdown and not args.compare:
        parser.error("--markdown needs --compare (the DeepSpeed side's JSON)")

    python = ensure_venv(args.venv or args.work / f"venv-{args.side}", args.side, args.reuse_venv)
    tests = export_tests(args.deepspeed_git, args.work / f"tree-{args.side}")
    groups = [g for g in args.groups.split(",") if g] or discover_groups(tests / "unit")
    skip = set(filter(None, args.skip_groups.split(",")))
    env = _clean_env()
    if args.local_size:
        env["LOCAL_SIZE"] = str(args.local_size)
    # As an activated venv: the launcher tests run the `deepspeed` console script by name.
    env["PATH"] = f"{python.parent}{os.pathsep}{env.get('PATH', '')}"
    # A JIT-op cache of this run's own: the shared one is rebuilt under other venvs' feet, and a build lock
    # a killed test leaves there would block everyone's loads.
    extensions = Path(env.get("TORCH_EXTENSIONS_DIR") or args.work / f"torch-extensions-{args.side}")
    env["TORCH_EXTENSIONS_DIR"] = str(extensions)
    if not args.no_prebuild:
        prebuild_ops(python, env)
    results: dict[str, dict[str, dict[str, str]]] = {}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for group in groups:
        if group in skip:
            continue
        if not (tests / "unit" / group.split("::", 1)[0]).exists():
            logger.warning("%s: not in this DeepSpeed checkout's tests/unit", group)
            continue
        results[group] = run_group(
            python,
            tests,
            group,
            args.work / f"runs-{args.side}",
            env,
            limit_s=args.timeout,
            grace_s=args.grace,
            exclude=args.exclude,
            extensions_dir=extensions,
            resume=args.resume,
        )
        logger.info("%s: %s", group, counts(results[group]))
        # Written after every group, so an interrupted run keeps what it measured.
        args.out.write_text(json.dumps(results, indent=1, sort_keys=True))
    args.out.write_text(json.dumps(results, indent=1, sort_keys=True))
    if args.compare:
        # Only the groups run here: a run of a few groups is compared on those.
        baseline = {g: r for g, r in json.loads(args.compare.read_text()).items() if g in results}
        print(compare(results, baseline))
        if args.markdown:
            args.markdown.write_text(markdown_table(results, baseline))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
