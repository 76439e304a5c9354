"""Hatch build hook of the ds-ops wheel: compile ops ahead of time when DS_BUILD_OPS=1 or DS_BUILD_<OP>=1.

Without those variables the hook does nothing: the wheel is pure Python (py3-none-any) and builds
in a second; ops then compile just in time on first use. With them, each selected op is compiled
by its builder (the same ninja build as the JIT path) into `ds_ops/_prebuilt/<op>.so`, a manifest
records the SIMD level and machine each was built for, and the wheel is tagged for this platform.
`DS_BUILD_OPS=1` skips an op this host cannot build (with a warning); `DS_BUILD_<OP>=1` makes that
an error. The libraries do not link Python or torch, so the wheel's tag is py3-none-<platform>.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import platform
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface
from packaging.tags import sys_tags

ROOT = Path(__file__).resolve().parent
PACKAGE_DIR = ROOT / "src" / "ds_ops"
BUILD_DIR = ROOT / "build" / "ds_ops_prebuilt"


@contextlib.contextmanager
def source_op_builder() -> Iterator[types.ModuleType]:
    """`ds_ops.op_builder` from this source tree, without running `ds_ops/__init__` (which imports torch).

    A stand-in `ds_ops` package pointing at the source folder is registered for the duration, then
    whatever was registered before is put back.
    """
    saved = {name: module for name, module in sys.modules.items() if name == "ds_ops" or name.startswith("ds_ops.")}
    for name in saved:
        del sys.modules[name]
    package = types.ModuleType("ds_ops")
    package.__path__ = [str(PACKAGE_DIR)]
    sys.modules["ds_ops"] = package
    try:
        yield importlib.import_module("ds_ops.op_builder")
    finally:
        for name in [n for n in sys.modules if n == "ds_ops" or n.startswith("ds_ops.")]:
            del sys.modules[name]
        sys.modules.update(saved)


class OpsBuildHook(BuildHookInterface):
    """Prebuilds the selected ops into the wheel."""

    PLUGIN_NAME = "custom"

    def dependencies(self) -> list[str]:
        """ninja joins the (isolated) build environment only when an AOT build is asked for."""
        asked = any(
            key.startswith("DS_BUILD_") and value.strip().lower() in ("1", "true", "yes", "on")
            for key, value in os.environ.items()
        )
        return ["ninja>=1.11"] if asked else []

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel" or version == "editable":
            return
        with source_op_builder() as op_builder:
            selected = op_builder.selected_ops(os.environ, op_builder.ALL_OPS)
            if not selected:
                return
            manifest: dict[str, dict[str, Any]] = {}
            for name, explicit in selected.items():
                entry = self._build_op(op_builder, name, explicit)
                if entry is not None:
                    library = BUILD_DIR / name / entry["file"]
                    build_data["force_include"][str(library)] = f"ds_ops/_prebuilt/{entry['file']}"
                    manifest[name] = entry
        if not manifest:
            return
        manifest_path = BUILD_DIR / "manifest.json"
        manifest_path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        build_data["force_include"][str(manifest_path)] = "ds_ops/_prebuilt/manifest.json"
        build_data["pure_python"] = False
        build_data["tag"] = f"py3-none-{next(iter(sys_tags())).platform}"

    def _build_op(self, op_builder: types.ModuleType, name: str, explicit: bool) -> dict[str, Any] | None:
        builder = op_builder.ALL_OPS[name]()
        compatibility = builder.can_build()
        if not compatibility:
            if explicit:
                raise RuntimeError(f"{op_builder.env_var(name)}=1 but op {name} cannot be built here: {compatibility}")
            self.app.display_warning(f"DS_BUILD_OPS=1: skipping op {name}: {compatibility}")
            return None
        started = time.perf_counter()
        library = builder.build(BUILD_DIR / name)
        self.app.display_info(f"prebuilt op {name} ({builder.simd_level()}) in {time.perf_counter() - started:.1f} s")
        return {
            "file": library.name,
            "simd": builder.simd_level(),
            "machine": platform.machine(),
            "abi": op_builder.ABI_VERSION,
        }
