"""What installing and testing the ds packages needs from the interpreter, and where a missing piece comes from.

The GPU machine has its own Python (torch preinstalled, no registry), so the packages are installed
there with `--no-deps --no-build-isolation`: pip resolves nothing and builds with what is importable.
Before that, every requirement the packages declare (their `[project].dependencies` minus in-tree
siblings, their `[build-system].requires`) and the test tools are checked against the installed
distributions. A requirement that is missing or out of range is taken from a folder of carried
wheels (`python tools/gpu_check.py --fetch-wheels` fills it on a machine with an index), together
with whatever those wheels need in turn; anything still missing stops the check before work starts,
with one message listing it all.
"""

from __future__ import annotations

import email.parser
import importlib.metadata
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.tags import sys_tags
    from packaging.utils import canonicalize_name, parse_wheel_filename
    from packaging.version import Version
except ImportError:  # every pip carries its own copy
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.tags import sys_tags  # type: ignore[no-redef]
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename  # type: ignore[no-redef]
    from pip._vendor.packaging.version import Version  # type: ignore[no-redef]

#: Needed to run the CUDA tests and the benchmark, beyond what the packages declare.
TEST_TOOLS = ("pytest>=8", "pytest-timeout>=2.3")

#: What `--fetch-wheels` downloads for the GPU machine's image (KINDS.md lists no pydantic, hjson or
#: hatchling there); their own requirements are fetched too (see `fetch_wheels`).
FETCH = ("pydantic>=2.6,<3", "hjson>=3.1", "hatchling>=1.25", "ninja>=1.11", "pytest-timeout>=2.3")


@dataclass
class Needs:
    """Requirements by the package(s) that ask for them."""

    runtime: dict[str, list[str]] = field(default_factory=dict)
    build: dict[str, list[str]] = field(default_factory=dict)

    def all(self) -> dict[str, list[str]]:
        merged: dict[str, list[str]] = {}
        for table in (self.build, self.runtime):
            for req, who in table.items():
                merged.setdefault(req, []).extend(w for w in who if w not in merged.get(req, []))
        return merged


def package_dirs(root: Path) -> list[Path]:
    """Every `packages/<dist>` with a pyproject, in name order."""
    return sorted(p for p in (root / "packages").glob("*") if (p / "pyproject.toml").is_file())


def dist_name(pkg: Path) -> str:
    return tomllib.loads((pkg / "pyproject.toml").read_text())["project"]["name"]


def declared_needs(root: Path) -> Needs:
    """Requirements of every in-tree package (siblings left out: they are installed from the tree)."""
    dirs = package_dirs(root)
    siblings = {canonicalize_name(dist_name(d)) for d in dirs}
    needs = Needs()
    for pkg in dirs:
        data = tomllib.loads((pkg / "pyproject.toml").read_text())
        name = data["project"]["name"]
        for table, reqs in (
            (needs.runtime, data["project"].get("dependencies", [])),
            (needs.build, data.get("build-system", {}).get("requires", [])),
        ):
            for text in reqs:
                req = Requirement(text)
                if canonicalize_name(req.name) in siblings or (req.marker and not req.marker.evaluate()):
                    continue
                table.setdefault(str(req), []).append(name)
    for tool in TEST_TOOLS:
        needs.runtime.setdefault(tool, []).append("the CUDA tests")
    return needs


def installed_version(name: str) -> str | None:
    """The version of distribution `name` this interpreter sees, else None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class Wheel:
    path: Path
    name: str
    version: Version

    def requirements(self) -> list[Requirement]:
        """The wheel's unconditional `Requires-Dist` (no extras; markers evaluated for this interpreter)."""
        with zipfile.ZipFile(self.path) as archive:
            meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
            message = email.parser.Parser().parsestr(archive.read(meta).decode())
        reqs = [Requirement(r) for r in message.get_all("Requires-Dist") or []]
        return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def carried_wheels(folder: Path | None) -> dict[str, list[Wheel]]:
    """Wheels in `folder` that this interpreter can install, by canonical name, newest first."""
    if folder is None or not folder.is_dir():
        return {}
    supported = set(sys_tags())
    found: dict[str, list[Wheel]] = {}
    for path in sorted(folder.glob("*.whl")):
        name, version, _build, tags = parse_wheel_filename(path.name)
        if tags & supported:
            found.setdefault(name, []).append(Wheel(path, name, version))
    for wheels in found.values():
        wheels.sort(key=lambda w: w.version, reverse=True)
    return found


@dataclass
class Resolution:
    """`present`: requirement -> installed version; `carried`: wheels to install; `missing`: what cannot be met."""

    present: dict[str, str] = field(default_factory=dict)
    carried: dict[str, Wheel] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)

    def message(self) -> str:
        return (
            "missing on this interpreter ("
            + sys.executable
            + ") and not among the carried wheels:\n  "
            + "\n  ".join(self.missing)
            + "\nOn a machine with a package index: python tools/gpu_check.py --fetch-wheels "
            "(fills .gpu_wheels/ for Python 3.12 x86-64), then carry .gpu_wheels with the run."
        )


def resolve(needs: dict[str, list[str]], wheels: dict[str, list[Wheel]]) -> Resolution:
    """Meet each requirement from what is installed, else from a carried wheel (and that wheel's needs)."""
    out = Resolution()
    todo = [(Requirement(text), ", ".join(who)) for text, who in needs.items()]
    while todo:
        req, who = todo.pop(0)
        key = canonicalize_name(req.name)
        chosen = out.carried.get(key)
        if chosen is not None:
            if chosen.version not in req.specifier:
                out.missing.append(f"{req} (for {who}): the carried {chosen.path.name} is out of range")
            continue
        have = installed_version(req.name)
        if have is not None and req.specifier.contains(have, prereleases=True):
            out.present[str(req)] = have
            continue
        wheel = next((w for w in wheels.get(key, []) if req.specifier.contains(w.version, prereleases=True)), None)
        if wheel is None:
            state = "not installed" if have is None else f"installed {have} is out of range"
            out.missing.append(f"{req} (for {who}): {state}")
            continue
        out.carried[key] = wheel
        todo += [(r, f"{wheel.name} {wheel.version}") for r in wheel.requirements()]
    return out


def install_wheels(wheels: list[Wheel], target: Path) -> list[str]:
    """The pip command that puts `wheels` into `target` (nothing resolved, nothing downloaded)."""
    return [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-index",
        "--no-deps",
        "--no-compile",
        "--disable-pip-version-check",
        "--target",
        str(target),
        *(str(w.path) for w in wheels),
    ]


def fetch_wheels(folder: Path, python_version: str = "3.12") -> int:
    """Download `FETCH` and their requirements as wheels for CPython `python_version` on x86-64 Linux.

    Run where pip reaches an index; the folder then travels with the GPU run (`carry`). Returns pip's
    exit status (the first that failed).
    """
    folder.mkdir(parents=True, exist_ok=True)
    platforms = [f"manylinux_2_{n}_x86_64" for n in (39, 35, 34, 31, 28, 27, 24, 17)] + ["manylinux2014_x86_64"]
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--only-binary=:all:",
        "--python-version",
        python_version,
        "--implementation",
        "cp",
        "--abi",
        f"cp{python_version.replace('.', '')}",
        "--abi",
        "abi3",
        "--abi",
        "none",
        *(arg for p in platforms for arg in ("--platform", p)),
        "--platform",
        "any",
        "--dest",
        str(folder),
        *FETCH,
    ]
    print("$ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=False).returncode
