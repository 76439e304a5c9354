"""Run DeepSpeedExamples' programs on ds and on DeepSpeed 0.19.8, side by side, on a CPU host.

    python tools/deepspeed_examples.py --side both --out /tmp/dsex/results.json --markdown /tmp/dsex/table.md
    python tools/deepspeed_examples.py --side ds --reuse-venv --venv V --only 'cifar10-*' --out F.json
    python tools/deepspeed_examples.py --side ds --reuse-venv --venv V --ds-from-tree ...   # this tree's code
    python tools/deepspeed_examples.py --list
    python tools/deepspeed_examples.py --table A.json B.json --out F.json   # merge results files, print the table

The unit tests (tools/deepspeed_unit_tests.py) measure ds's API piece by piece; this measures whole programs
people run: DeepSpeedExamples' CIFAR-10 (ZeRO 2/3, MoE, PR-MoE), the pipeline-parallel AlexNet, HelloDeepSpeed
BERT with CPU offload and resume, the bf16 master-weights example, AutoTP, variable batch size, SuperOffload,
offload_states, and DeepSpeed-Chat where its recipes are present (tools/_examples_chat.py).

Each program is exported from a DeepSpeedExamples git directory (`--examples-git`, `git archive HEAD <folder>`)
into a scratch folder (`--work`); nothing of DeepSpeedExamples is committed here. Its recipe (a `Program` in
tools/_examples_training.py or tools/_examples_chat.py) makes the fewest edits that let it run offline in a
minute or two: synthetic data and local tiny models instead of downloads, small sizes through the program's own
arguments, a loss print where it has none. Every edit names the text it replaces and fails loudly when
DeepSpeedExamples changes it.

Sides: `deepspeed` runs the pinned release from `--deepspeed-python` (default /work/dsref/bin/python, with the
`deepspeed` launcher beside it); `ds` runs this tree's `deepspeed` distribution from a venv (`--venv`, created
and filled on first use with torch, transformers, accelerate, datasets, hjson, pydantic, ninja and the packages
installed editable; `--reuse-venv` takes an existing venv as it is). Both run with DS_ACCELERATOR=cpu, one
OpenMP thread per rank, ranks launched by each side's own `deepspeed --num_gpus N` (DeepSpeed's launcher
starts N CPU ranks on a CPU host), a free `--master_port` per run, op builds cached per side under `--work`.
Pure-Python packages a program imports that neither venv has (HelloDeepSpeed's fire, loguru, tensorboard...)
are installed without dependencies into one folder on both sides' PYTHONPATH.

Per program and side the results JSON records ran / failed with the first error line, every logged loss, and
wall time; `--side both` runs DeepSpeed then ds for each program. A run merges into an existing `--out`, so the
sides can run separately. The table compares the sides' losses where the program is deterministic.
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _examples_edit import RecipeError
from _examples_program import LAUNCHER, PYTHON, Program
from _examples_report import first_error, markdown_table, merge, notes_list, parse_losses

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ROOT / "packages"
EXAMPLES_GIT = Path("/work/.mirror/deepspeedai+DeepSpeedExamples/repo")
DEEPSPEED_PYTHON = Path("/work/dsref/bin/python")
# What the programs import beside torch (both sides' venvs need them; /work/dsref has them).
# --ds-from-tree: the ds side imports this tree's packages/*/src ahead of what its venv has installed (a venv
# filled from another checkout runs this checkout's code).
DS_FROM_TREE = False
VENV_REQUIREMENTS = ("torch", "transformers", "accelerate", "datasets", "hjson", "pydantic", "ninja", "numpy")


def all_programs() -> tuple[list[Program], list[str]]:
    """The training recipes, then DeepSpeed-Chat's when tools/_examples_chat.py is there; and notes on what is not."""
    import _examples_training

    programs, notes = list(_examples_training.programs()), []
    try:
        import _examples_chat  # type: ignore[import-not-found]
    except ModuleNotFoundError as error:
        if error.name != "_examples_chat":
            raise
        notes.append("DeepSpeed-Chat: tools/_examples_chat.py is absent; its programs were skipped.")
    else:
        programs.extend(_examples_chat.programs())
    return programs, notes


def export_folder(git_dir: Path, folder: str, dest: Path) -> list[str]:
    """`folder` of the checkout's HEAD into `dest` (keeping its path); returns the files it could not read.

    `git archive` stops at the first blob a partial clone lacks (large media files); then the folder is
    exported file by file and the missing ones are listed (a program needing one fails on it, visibly).
    """
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "--git-dir", str(git_dir), "archive", "HEAD", folder], capture_output=True)
    if archive.returncode == 0:
        subprocess.run(["tar", "x", "-C", str(dest)], input=archive.stdout, check=True)
        return []
    listing = subprocess.run(
        ["git", "--git-dir", str(git_dir), "ls-tree", "-r", "-z", "HEAD", folder], capture_output=True, check=True
    ).stdout.decode()
    missing = []
    for entry in filter(None, listing.split("\0")):
        meta, path = entry.split("\t", 1)
        mode, kind, blob = meta.split()
        if kind != "blob":
            continue
        read = subprocess.run(["git", "--git-dir", str(git_dir), "cat-file", "blob", blob], capture_output=True)
        if read.returncode != 0:
            missing.append(path)
            continue
        target = dest / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(read.stdout)
        if mode == "100755":
            target.chmod(0o755)
    return missing


def ensure_ds_venv(venv: Path, reuse: bool) -> Path:
    """A venv with this tree's packages installed editable (created and filled unless `reuse`)."""
    python = venv / "bin" / "python"
    if reuse:
        if not python.exists():
            raise SystemExit(f"--reuse-venv: no interpreter at {python}")
        return python
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    env = _base_env()
    subprocess.run([*pip, "-c", str(ROOT / "constraints.txt"), *VENV_REQUIREMENTS], check=True, env=env)
    packages = [str(p) for p in sorted(PACKAGES.iterdir()) if (p / "pyproject.toml").exists()]
    subprocess.run([*pip, "--no-deps", *[arg for p in packages for arg in ("-e", p)]], check=True, env=env)
    return python


def ensure_requirements(folder: Path, requirements: set[str]) -> None:
    """Install the programs' extra pure-Python packages (no dependencies) into `folder`, those not there yet."""
    done_file = folder / ".installed"
    done = set(done_file.read_text().split()) if done_file.exists() else set()
    wanted = sorted(requirements - done)
    if not wanted:
        return
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(folder), *wanted],
        check=True,
        env=_base_env(),
    )
    done_file.write_text("\n".join(sorted(done | set(wanted))) + "\n")


# Builds the JIT ops the programs load (DeepSpeed on a CPU host compiles its shm allreduce, its CPU FusedAdam and
# CPUAdam on first use: minutes each on 2 cores), so no program's wall time or timeout includes a compile.
_PREBUILD = """
import time
import deepspeed.ops.op_builder as ops
from deepspeed.accelerator import get_accelerator
create = getattr(get_accelerator(), "create_op_builder", None)
for name in ("ShareMemCommBuilder", "FusedAdamBuilder", "CPUAdamBuilder"):
    start = time.time()
    builder = create(name) if create else getattr(ops, name, lambda: None)()
    if builder is not None:
        builder.load()
        print(f"built {name} in {time.time() - start:.0f} s", flush=True)
"""


def clear_stale_locks(work: Path, side: str, since: float = 0.0) -> None:
    """Remove build locks left in the side's extensions folder by a run this tool ended mid-compile.

    The folder is this tool's alone and one invocation runs one command at a time, so at its start no lock
    there is live (`since` 0: all go), and after a run it had to kill, the locks made since that run began
    are that run's; a stale one would make every later build of that op wait on it forever.
    """
    for lock in (work / f"torch-extensions-{side}").glob("*/lock"):
        if lock.stat().st_mtime >= since:
            print(f"removing the stale build lock {lock}", file=sys.stderr)
            lock.unlink(missing_ok=True)


def prebuild_ops(python: Path, side: str, work: Path, timeout_s: int) -> None:
    """Compile the side's JIT ops into its extensions folder once, before any program runs."""
    env = _side_env(python, side, work)
    log = work / "logs" / side / "prebuild.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        rc = _run([str(python), "-c", _PREBUILD], work, env, out, timeout_s)
    if rc != 0:
        print(f"prebuild [{side}]: {'timed out' if rc is None else f'exit {rc}'}; see {log}", file=sys.stderr)


def _side_env(python: Path, side: str, work: Path) -> dict[str, str]:
    """The environment every command of one side runs in (a program adds its own on top)."""
    env = _base_env()
    env.update(
        DS_ACCELERATOR="cpu",
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        TOKENIZERS_PARALLELISM="false",
        WANDB_MODE="disabled",
        TORCH_EXTENSIONS_DIR=str(work / f"torch-extensions-{side}"),
        PATH=f"{python.parent}{os.pathsep}{os.environ.get('PATH', '')}",
    )
    paths = [str(work / "extras")] if (work / "extras").is_dir() else []
    if side == "ds" and DS_FROM_TREE:
        paths = [str(src) for src in sorted(PACKAGES.glob("*/src"))] + paths
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def _base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def expand(argv: tuple[str, ...], python: Path, launcher: Path, port: int) -> list[str]:
    """`argv` with the side's interpreter and launcher (plus `--master_port`) in place of the placeholders."""
    launch = [str(launcher), "--master_port", str(port)]
    out: list[str] = []
    for arg in argv:
        if arg == LAUNCHER:
            out.extend(launch)
        else:
            out.append(arg.replace(LAUNCHER, shlex.join(launch)).replace(PYTHON, str(python)))
    return out


def _run(command: list[str], cwd: Path, env: dict[str, str], log: Any, timeout_s: float) -> int | None:
    """Run one command, its output appended to `log`; its exit code, or None when it ran past `timeout_s`.

    Each command leads its own process group, so a timeout ends the launcher and every rank it started.
    """
    log.write(f"$ {shlex.join(command)}\n")
    log.flush()
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return process.wait(timeout=max(timeout_s, 1))
    except subprocess.TimeoutExpired:
        for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            try:
                process.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
        return None


def run_program(program: Program, side: str, python: Path, export_root: Path, work: Path) -> dict[str, Any]:
    """Prepare a fresh copy of `program`, run its setup and command on one side, and read the outcome."""
    launcher = python.parent / "deepspeed"
    run_root = work / "runs" / side / program.name
    shutil.rmtree(run_root, ignore_errors=True)
    source_dir = export_root / program.source
    shutil.copytree(source_dir, run_root)
    result: dict[str, Any] = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")}
    log_path = work / "logs" / side / f"{program.name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    result["log"] = str(log_path)
    try:
        run_dir = program.prepare(source_dir, run_root)
    except RecipeError as error:
        log_path.write_text(f"recipe: {error}\n")
        return {**result, "status": "not prepared", "rc": None, "first_error": str(error), "losses": [], "wall_s": 0.0}
    env = {**_side_env(python, side, work), "HF_HOME": str(run_root / ".hf"), **program.env}
    start, started_at = time.monotonic(), time.time()
    rc: int | None = 0
    with open(log_path, "w") as log:
        for command in (*program.setup, program.argv):
            remaining = program.timeout_s - (time.monotonic() - start)
            rc = _run(expand(command, python, launcher, _free_port()), run_dir, env, log, remaining)
            if rc != 0:
                break
    wall = time.monotonic() - start
    if rc is None:
        clear_stale_locks(work, side, since=started_at)
    output = log_path.read_text(errors="replace")
    status = "ran" if rc == 0 else ("timeout" if rc is None else "failed")
    return {
        **result,
        "status": status,
        "rc": rc,
        "first_error": ""
        if rc == 0
        else (first_error(output) if rc is not None else f"ran past {program.timeout_s} s"),
        "losses": parse_losses(output, program.loss_pattern),
        "wall_s": round(wall, 1),
    }


def _select(programs: list[Program], only: str) -> list[Program]:
    if not only:
        return programs
    chosen: list[Program] = []
    for pattern in only.split(","):  # in the order asked for
        chosen.extend(p for p in programs if fnmatch.fnmatchcase(p.name, pattern) and p not in chosen)
    if not chosen:
        raise SystemExit(f"--only {only!r} matches no program; --list shows them")
    return chosen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--side", choices=("ds", "deepspeed", "both"), default="both")
    parser.add_argument("--examples-git", type=Path, default=EXAMPLES_GIT, help="a DeepSpeedExamples git directory")
    parser.add_argument("--deepspeed-python", type=Path, default=DEEPSPEED_PYTHON, help="DeepSpeed 0.19.8's python")
    parser.add_argument("--venv", type=Path, help="ds's venv (default: WORK/venv-ds), created and filled if needed")
    parser.add_argument("--reuse-venv", action="store_true", help="use --venv as it is, no install")
    parser.add_argument("--work", type=Path, default=Path("/tmp/dsex"), help="scratch folder")
    parser.add_argument("--only", default="", help="comma-separated program names or shell patterns, run in that order")
    parser.add_argument("--out", type=Path, help="results JSON; an existing one is merged into")
    parser.add_argument("--markdown", type=Path, help="write the table (and the recipes' notes) here too")
    parser.add_argument(
        "--ds-from-tree",
        action="store_true",
        help="run the ds side on this tree's packages/*/src (on PYTHONPATH) rather than the venv's installed ds",
    )
    parser.add_argument("--no-prebuild", action="store_true", help="skip compiling the JIT ops before the runs")
    parser.add_argument("--list", action="store_true", help="list the programs and exit")
    parser.add_argument(
        "--table",
        type=Path,
        nargs="+",
        help="print the markdown table of results JSONs (merged in order; into --out if given) and exit",
    )
    args = parser.parse_args()

    if args.table:
        results: dict[str, Any] = {}
        for path in args.table:
            results = merge(results, json.loads(path.read_text()))
        if args.out:
            args.out.write_text(json.dumps(results, indent=1) + "\n")
        table = markdown_table(results) + "\n\n" + notes_list(results)
        if args.markdown:
            args.markdown.write_text(table + "\n")
        print(table)
        return 0
    global DS_FROM_TREE
    DS_FROM_TREE = args.ds_from_tree
    programs, notes = all_programs()
    if args.list:
        for program in programs:
            print(f"{program.name:32} {program.source}")
        for note in notes:
            print(note)
        return 0
    programs = _select(programs, args.only)
    sides = ("deepspeed", "ds") if args.side == "both" else (args.side,)
    pythons = {"deepspeed": args.deepspeed_python}
    if "ds" in sides:
        pythons["ds"] = ensure_ds_venv(args.venv or args.work / "venv-ds", args.reuse_venv)
    ensure_requirements(args.work / "extras", {r for p in programs for r in p.requirements})
    for side in sides:
        clear_stale_locks(args.work, side)
        if not args.no_prebuild:
            prebuild_ops(pythons[side], side, args.work, timeout_s=3600)

    commit = subprocess.run(
        ["git", "--git-dir", str(args.examples_git), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    export_root = args.work / "export" / commit[:12]
    for source in sorted({p.source for p in programs}):
        if not (export_root / source).exists():
            for path in export_folder(args.examples_git, source, export_root):
                print(f"export: {path} is not in this checkout (skipped)", file=sys.stderr)

    results = {"examples_commit": commit, "notes": notes, "programs": {}}
    if args.out and args.out.exists():
        results = merge(json.loads(args.out.read_text()), results)
    for program in programs:
        entry = {
            "source": program.source,
            "deterministic": program.deterministic,
            "notes": program.notes,
            "command": shlex.join(program.argv),
            "sides": {},
        }
        for side in sides:
            outcome = run_program(program, side, pythons[side], export_root, args.work)
            entry["sides"][side] = outcome
            losses = outcome["losses"]
            shown = f"{losses[0]:.4f} -> {losses[-1]:.4f} ({len(losses)})" if losses else "no losses"
            print(f"{program.name} [{side}]: {outcome['status']} in {outcome['wall_s']:.0f} s, {shown}", flush=True)
            if outcome["status"] != "ran":
                print(f"    {outcome['first_error']}  (log: {outcome['log']})", flush=True)
        results = merge(results, {"programs": {program.name: entry}})
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1) + "\n")
    table = markdown_table(results) + "\n\n" + notes_list(results)
    if args.markdown:
        args.markdown.write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
