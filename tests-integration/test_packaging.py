"""Packaging: every package builds a wheel and an sdist, and pip resolves exactly the declared siblings.

The resolution checks use `pip install --dry-run --report` against the freshly built wheels, so they
see what a user's `pip install 'ds-engine[zero,pipe]'` would pull without creating a venv.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists())


@pytest.fixture(scope="module")
def wheel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheels")
    for pkg in PACKAGES:
        subprocess.run(
            [sys.executable, "-m", "hatchling", "build", "-d", str(out)],
            cwd=pkg,
            check=True,
            capture_output=True,
            timeout=300,
        )
    return out


def _resolve(wheel_dir: Path, requirement: str) -> set[str]:
    report = wheel_dir / "report.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "-q",
            "--find-links",
            str(wheel_dir),
            "-c",
            str(ROOT / "constraints.txt"),
            "--report",
            str(report),
            requirement,
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    installs = json.loads(report.read_text())["install"]
    return {item["metadata"]["name"].lower() for item in installs if item["metadata"]["name"].startswith("ds-")}


@pytest.mark.timeout(600)
def test_every_package_builds_wheel_and_sdist(wheel_dir: Path) -> None:
    for pkg in PACKAGES:
        stem = pkg.name.replace("-", "_")
        wheels = list(wheel_dir.glob(f"{stem}-*.whl"))
        assert len(wheels) == 1, pkg.name
        assert list(wheel_dir.glob(f"{stem}-*.tar.gz")), f"{pkg.name} has no sdist"
        names = zipfile.ZipFile(wheels[0]).namelist()
        assert f"{stem}/__init__.py" in names and f"{stem}/py.typed" in names


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("requirement", "expected"),
    [
        ("ds-engine[zero,pipe]", {"ds-engine", "ds-comm", "ds-ops", "ds-zero", "ds-pipe"}),
        ("ds-engine[all]", {"ds-engine", "ds-comm", "ds-ops", "ds-zero", "ds-pipe", "ds-parallel"}),
        ("ds-parallel", {"ds-parallel", "ds-comm"}),
        ("ds-engine", {"ds-engine", "ds-comm", "ds-ops"}),
        ("ds-zero", {"ds-zero", "ds-comm", "ds-ops"}),
        ("ds-pipe", {"ds-pipe", "ds-comm"}),
        ("ds-launcher", {"ds-launcher", "ds-comm"}),
    ],
)
def test_install_pulls_exactly_declared_siblings(wheel_dir: Path, requirement: str, expected: set[str]) -> None:
    assert _resolve(wheel_dir, requirement) == expected


@pytest.mark.timeout(600)
def test_deepspeed_distribution_pulls_the_whole_stack_and_no_script(wheel_dir: Path) -> None:
    # Pinned to this tree's version: an index may also offer upstream DeepSpeed under the same name.
    about = (ROOT / "packages" / "deepspeed" / "src" / "deepspeed" / "__about__.py").read_text()
    version = about.split('__version__ = "')[1].split('"')[0]
    assert _resolve(wheel_dir, f"deepspeed=={version}") == {
        "ds-engine",
        "ds-comm",
        "ds-ops",
        "ds-zero",
        "ds-pipe",
        "ds-parallel",
        "ds-launcher",
    }
    wheel = next(wheel_dir.glob("deepspeed-*.whl"))
    entry_points = [n for n in zipfile.ZipFile(wheel).namelist() if n.endswith("entry_points.txt")]
    assert entry_points == []  # ds-launcher owns the `deepspeed` command
