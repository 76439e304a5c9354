"""Publish a finished directory under its final name with one rename, replacing an existing one atomically.

A checkpoint tag directory built aside (`_deepspeed_layout`) becomes visible all at once. When a
directory of that name already exists (the same tag saved again), Linux's `renameat2(RENAME_EXCHANGE)`
swaps the two in one step, so at every instant the name holds a complete directory, the old one or the
new one; where the call or the file system lacks it, the old directory is renamed aside first (a crash
between the two renames leaves the old one under `<name>.replaced-<pid>` beside it, named in the log).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
from pathlib import Path

from ds_comm import fsync_dir

logger = logging.getLogger(__name__)

__all__ = ["publish_dir"]

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap `a` and `b` atomically (renameat2); False where the kernel, libc or file system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"renameat2(RENAME_EXCHANGE) of {a} and {b}: {os.strerror(err)}")


def publish_dir(built: Path, target: Path) -> None:
    """Make the complete directory `built` appear as `target` (same file system), replacing any `target`.

    Raises:
        OSError: the rename failed; `target` is then unchanged.
    """
    if target.is_dir() and _exchange(built, target):
        fsync_dir(target.parent)
        shutil.rmtree(built)  # now the old directory
        return
    aside = None
    if target.exists():
        aside = target.with_name(f"{target.name}.replaced-{os.getpid()}")
        os.replace(target, aside)
        logger.info("moved %s aside to %s while publishing its replacement", target, aside)
    os.replace(built, target)
    fsync_dir(target.parent)
    if aside is not None:
        shutil.rmtree(aside)
