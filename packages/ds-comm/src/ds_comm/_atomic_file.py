"""Crash-safe file writes for every checkpoint kind: a unique temporary sibling, fsync, `os.replace`, fsync.

A reader (or a later load) sees either the old file or the complete new one, never a torn write:
`os.replace` is atomic on POSIX within one filesystem, the file's data is on disk before the rename
(fsync of the file), and the rename itself is on disk before the call returns (fsync of the
directory), so a power loss after a checkpoint's `latest` was switched cannot leave `latest` naming
a file whose bytes never reached the disk.

[Note: why a unique temporary name] Two writers of the same file (two ranks, two jobs sharing a
directory, a retried save) must not write into one temporary file; each gets its own
`.<name>.<pid>.<random>.tmp`, created exclusively, and a failed write removes it.

[Note: fault points] `_event` is called at each step of a write, before the step happens:
`open` (no temporary file yet), `write` (an empty temporary file exists), `fsync` (the data is
written, not yet synced), `replace` (synced, not yet renamed), `fsync_dir` (renamed, the directory
entry not yet synced). Tests install a hook there (`ds_comm.testing.file_events`) to kill the
process at every one of those points.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = ["atomic_save", "atomic_write", "atomic_write_text", "fsync_dir"]

#: Called as `hook(event, final_path)` before each step of a write; None outside fault-injection tests.
_hook: Callable[[str, Path], None] | None = None


def _event(name: str, path: Path) -> None:
    if _hook is not None:
        _hook(name, path)


def _temp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp")


def _fsync_file(path: Path) -> None:
    # Any descriptor of the file flushes its data on Linux, so the writer may have closed its own.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: Path) -> None:
    """Make a rename in `directory` durable; filesystems that cannot sync a directory are skipped."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as err:
        logger.debug("fsync of directory %s not supported: %s", directory, err)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike[str], write: Callable[[Path], None]) -> None:
    """Produce `path` with `write(tmp_path)`, atomically: all of the new file or the old one, never part.

    `write` receives a fresh, empty temporary file's path in the same directory and must leave the
    complete content there (it may reopen or truncate it: `torch.save(obj, tmp)`, a checkpoint
    engine's `save(obj, str(tmp))`). Then the file is fsynced, renamed over `path` with
    `os.replace`, and the directory is fsynced.

    Args:
        path: the final file; its directory must exist.
        write: writes the whole content to the path it is given.

    Raises:
        Whatever `write` or the filesystem raises; the temporary file is removed first and `path`
        is left as it was.
    """
    path = Path(path)
    tmp = _temp_path(path)
    _event("open", path)
    try:
        with open(tmp, "xb"):  # exclusive create: the name is ours (permissions follow the umask)
            pass
        _event("write", path)
        write(tmp)
        _event("fsync", path)
        _fsync_file(tmp)
        _event("replace", path)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _event("fsync_dir", path)
    fsync_dir(path.parent)


def atomic_save(obj: Any, path: str | os.PathLike[str], *, serialization: bool = True) -> None:
    """`torch.save(obj, path)`, atomically (see `atomic_write`).

    Args:
        obj: anything `torch.save` accepts.
        path: the final file; its directory must exist.
        serialization: torch's zipfile format (True, the default) or the legacy one (False), as
            the engine's `checkpoint.checkpoint_serialization` selects.
    """
    atomic_write(path, lambda tmp: torch.save(obj, tmp, _use_new_zipfile_serialization=serialization))


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write `text` exactly (no newline added) to `path`, atomically; used for a checkpoint's `latest`."""
    atomic_write(path, lambda tmp: tmp.write_text(text))
