"""A tiny op (adds two ints) for builder tests: compiles in well under a second."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar

from ds_ops.op_builder import ABI_VERSION, OpBuilder

GOOD_SOURCE = """#include <cstdint>
#define EXPORT extern "C" __attribute__((visibility("default")))
EXPORT int32_t ds_op_abi_version() { return ABI; }
EXPORT const char* ds_op_simd_level() { return "toy"; }
EXPORT int32_t toy_add(int32_t a, int32_t b) { return a + b; }
""".replace("ABI", str(ABI_VERSION))

BROKEN_SOURCE = GOOD_SOURCE.replace("return a + b;", "return a + undeclared_thing;")


def write_toy(root: Path, source: str = GOOD_SOURCE) -> Path:
    """Write the toy's source under `root` and return `root`."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "toy_add.cpp").write_text(source)
    return root


class ToyBuilder(OpBuilder):
    """An op whose sources live in a folder given at construction, with optional extra compiler flags."""

    NAME = "toy_add"
    SOURCES = ("toy_add.cpp",)
    INCLUDE_DIRS = ()
    FUNCTIONS: ClassVar = {"toy_add": (ctypes.c_int32, (ctypes.c_int32, ctypes.c_int32))}

    def __init__(self, root: Path, extra_flags: tuple[str, ...] = ()) -> None:
        super().__init__()
        self._root = Path(root)
        self._extra_flags = list(extra_flags)

    def csrc_root(self) -> Path:
        return self._root

    def cxx_args(self) -> list[str]:
        return [*super().cxx_args(), *self._extra_flags]


TESTS_DIR = Path(__file__).resolve().parent

# Prefix for child scripts that use only ds_ops.op_builder: registers a bare `ds_ops` package so
# `ds_ops/__init__` (which imports torch for the optimizers) does not run. The builders need no
# torch (the wheel's build hook relies on it), and the child starts in a fraction of the time.
WITHOUT_TORCH = (
    "import importlib.util, sys, types\n"
    "_spec = importlib.util.find_spec('ds_ops')\n"
    "_pkg = types.ModuleType('ds_ops'); _pkg.__path__ = list(_spec.submodule_search_locations)\n"
    "sys.modules['ds_ops'] = _pkg\n"
)


def subprocess_env(extra: Mapping[str, str] | None = None, pythonpath: tuple[Path, ...] = ()) -> dict[str, str]:
    """This process's environment for a child Python: `pythonpath` first, then this tests folder and sys.path."""
    env = dict(os.environ)
    entries = [str(p) for p in pythonpath] + [str(TESTS_DIR)] + [p for p in sys.path if p and os.path.isdir(p)]
    env["PYTHONPATH"] = os.pathsep.join(entries)
    env.update(extra or {})
    return env


def run_python(
    code: str, env: Mapping[str, str], args: tuple[str, ...] = (), timeout_s: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run `code` (with `args` as sys.argv[1:]) in a fresh interpreter; fail with its output if it exits non-zero."""
    result = subprocess.run(
        [sys.executable, "-c", code, *args],
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert result.returncode == 0, f"child failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    return result
