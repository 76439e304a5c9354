"""Shared by the aio tests: the engines this host runs, test data, and file system mounts (as root)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ds_ops.op_builder import io_uring_status

IO_URING_OK, IO_URING_WHY_NOT = io_uring_status()
#: Engines to test: psync always, io_uring where this process may use it.
ENGINES = [
    "psync",
    pytest.param("io_uring", marks=pytest.mark.skipif(not IO_URING_OK, reason=f"no io_uring: {IO_URING_WHY_NOT}")),
]


def random_bytes(nbytes: int, seed: int) -> torch.Tensor:
    """`nbytes` random uint8 values (so every byte position is checked)."""
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def unaligned_empty(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 tensor whose first byte is NOT 4096-aligned (forces the bounce path)."""
    base = torch.empty(nbytes + 4096 + 1, dtype=torch.uint8)
    shift = (-base.data_ptr()) % 4096 + 1
    return base[shift : shift + nbytes]


@contextlib.contextmanager
def mounted(target: Path, fstype: str, options: str) -> Iterator[Path]:
    """Mount a fresh `fstype` file system on `target` for the block; skip the test where mounting is
    not permitted (not root, or no CAP_SYS_ADMIN in this container)."""
    target.mkdir(parents=True, exist_ok=True)
    try:
        result = subprocess.run(
            ["mount", "-t", fstype, "-o", options, fstype, str(target)],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except OSError as err:
        pytest.skip(f"cannot run mount: {err}")
    if result.returncode != 0:
        pytest.skip(f"mount -t {fstype} not permitted here: {result.stderr.strip() or result.returncode}")
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], capture_output=True, timeout=30, check=False)
