"""Ops compiled into the wheel at install time (AOT): where they are and whether this host can use them.

The AOT build hook writes `ds_ops/_prebuilt/<op>.so` and `ds_ops/_prebuilt/manifest.json`:
`{"<op>": {"file": "<op>.so", "simd": "avx2", "machine": "x86_64", "abi": 1}}`. A library built for
a wider SIMD level than this CPU runs, or for another machine, is ignored and the op is JIT-built.
"""

from __future__ import annotations

import functools
import json
import logging
import platform
from pathlib import Path
from typing import Any

from ds_ops.op_builder._toolchain import can_run, detect_simd

logger = logging.getLogger(__name__)

PREBUILT_DIR = Path(__file__).resolve().parent.parent / "_prebuilt"
MANIFEST_NAME = "manifest.json"


@functools.lru_cache(maxsize=1)
def read_manifest(directory: Path = PREBUILT_DIR) -> dict[str, dict[str, Any]]:
    """The manifest of prebuilt ops ({} for a pure-Python install)."""
    path = directory / MANIFEST_NAME
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        logger.warning("ignoring unreadable prebuilt-op manifest %s: %s", path, err)
        return {}
    return data if isinstance(data, dict) else {}


def prebuilt_entry(op_name: str, directory: Path = PREBUILT_DIR) -> dict[str, Any] | None:
    """The manifest entry of `op_name`, or None when the wheel has no library for it."""
    entry = read_manifest(directory).get(op_name)
    if not isinstance(entry, dict) or not (directory / str(entry.get("file", ""))).exists():
        return None
    return entry


def usable_prebuilt(op_name: str, abi_version: int, directory: Path = PREBUILT_DIR) -> tuple[Path | None, str]:
    """(path of a prebuilt library this host can run, "") or (None, why not)."""
    entry = prebuilt_entry(op_name, directory)
    if entry is None:
        return None, "not in the wheel"
    if entry.get("machine") != platform.machine():
        return None, f"built for {entry.get('machine')}, this host is {platform.machine()}"
    if not can_run(str(entry.get("simd")), detect_simd()):
        return None, f"built for SIMD level {entry.get('simd')}, this CPU has {detect_simd()}"
    if entry.get("abi") != abi_version:
        return None, f"built for op ABI {entry.get('abi')}, this ds-ops needs {abi_version}"
    return directory / str(entry["file"]), ""
