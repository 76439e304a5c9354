"""AOT: the wheel is pure Python without DS_BUILD_*; with DS_BUILD_<OP>=1 it carries the compiled op,
and load() uses it (no compiler needed on the installing host)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from _toy_ops import run_python, subprocess_env

WheelBuilder = pytest.importorskip("hatchling.builders.wheel", reason="needs hatchling").WheelBuilder

PACKAGE_DIR = Path(__file__).resolve().parents[1]


def _copy_package(tmp_path: Path) -> Path:
    """A copy of the package folder to build from (the hook writes under build/)."""
    source = tmp_path / "ds-ops"
    shutil.copytree(
        PACKAGE_DIR,
        source,
        ignore=shutil.ignore_patterns("build", "dist", "__pycache__", "*.egg-info", ".pytest_cache"),
    )
    return source


def _build_wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **env: str) -> Path:
    """Build the wheel in-process with hatchling (what pip's build backend runs), DS_BUILD_* from `env` only."""
    for key in [k for k in os.environ if k.startswith("DS_BUILD_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    builder = WheelBuilder(str(_copy_package(tmp_path)))
    (wheel,) = builder.build(directory=str(tmp_path / "wheels"), versions=["standard"])
    return Path(wheel)


def test_plain_wheel_is_pure_python_with_sources_for_jit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wheel = _build_wheel(tmp_path, monkeypatch)
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.startswith("ds_ops/_prebuilt/") or n.endswith(".so")]
    assert "ds_ops/csrc/adam/cpu_adam.cpp" in names and "ds_ops/csrc/includes/ds_cpu_optim.h" in names
    assert "ds_ops/csrc/adam/fused_adam.cu" in names
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "ds_report = ds_ops.report:main" in entry_points


USE_PREBUILT = textwrap.dedent("""
    import sys, torch
    import ds_ops
    from ds_ops import CPUAdamBuilder, CPULionBuilder, DeepSpeedCPULion, OpNotCompatibleError
    builder = CPULionBuilder()
    builder.load()
    print("FROM", builder.loaded_from, ds_ops.__file__.startswith(sys.argv[1]))
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = DeepSpeedCPULion([param], lr=0.25)
    param.grad = torch.ones(3)
    optimizer.step()
    print("PARAM", param.tolist())
    try:
        CPUAdamBuilder().load()  # not prebuilt: needs the (missing) compiler
    except OpNotCompatibleError as err:
        print("ADAM", "not found" in str(err))
""")


@pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler")
def test_ds_build_op_compiles_it_into_the_wheel_and_load_uses_it(tmp_path: Path) -> None:
    """Through pip, as a user would: `DS_BUILD_CPU_LION=1 pip wheel ...`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DS_BUILD_")} | {"DS_BUILD_CPU_LION": "1"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "wheels"),
            str(_copy_package(tmp_path)),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = (tmp_path / "wheels").glob("ds_ops-*.whl")
    assert not wheel.name.endswith("-none-any.whl") and wheel.name.startswith("ds_ops-0"), wheel.name
    assert "-py3-none-" in wheel.name  # the library links neither Python nor torch
    archive = zipfile.ZipFile(wheel)
    assert {"ds_ops/_prebuilt/cpu_lion.so", "ds_ops/_prebuilt/manifest.json"} <= set(archive.namelist())
    assert not [n for n in archive.namelist() if n.endswith(".so") and "cpu_lion" not in n]
    manifest = json.loads(archive.read("ds_ops/_prebuilt/manifest.json"))
    assert set(manifest) == {"cpu_lion"} and manifest["cpu_lion"]["file"] == "cpu_lion.so"

    installed = tmp_path / "site"
    archive.extractall(installed)
    env = subprocess_env(
        {"CXX": str(tmp_path / "no-compiler"), "TORCH_EXTENSIONS_DIR": str(tmp_path / "empty")}, pythonpath=(installed,)
    )
    out = run_python(USE_PREBUILT, env, args=(str(installed),)).stdout
    assert "FROM prebuilt True" in out, out
    assert "PARAM [0.75, 0.75, 0.75]" in out, out
    assert "ADAM True" in out, out
    assert not (tmp_path / "empty").exists() or not any((tmp_path / "empty").rglob("*.so"))


def test_asking_for_an_op_that_cannot_build_fails_the_wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", str(tmp_path / "no-compiler"))
    with pytest.raises(
        RuntimeError,
        match="DS_BUILD_CPU_ADAM=1 but op cpu_adam cannot be built here: C.. compiler .*no-compiler' not found",
    ):
        _build_wheel(tmp_path, monkeypatch, DS_BUILD_CPU_ADAM="1")
