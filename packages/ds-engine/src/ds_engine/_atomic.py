"""Crash-safe file writes: write to a hidden temporary name in the same directory, fsync, then rename.

A reader (or a later load) therefore sees either the old file or the complete new one, never a
torn write; `os.replace` is atomic on POSIX within one filesystem.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["atomic_save", "atomic_write_text", "temp_name"]


def temp_name(path: Path) -> Path:
    """The hidden temporary sibling `path` is written to first."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def _write(handle: Any, obj: Any, serialization: bool) -> None:
    # The one place bytes reach the disk; tests replace it to simulate a crash mid-save.
    torch.save(obj, handle, _use_new_zipfile_serialization=serialization)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_save(obj: Any, path: Path, *, serialization: bool = True) -> None:
    """`torch.save(obj, path)`, atomically (temporary file + fsync + `os.replace`)."""
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as handle:
            _write(handle, obj, serialization)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` atomically (used for `latest`, which must switch tags in one step)."""
    tmp = temp_name(path)
    try:
        with open(tmp, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
