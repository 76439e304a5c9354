"""NVMe swap files: the per-rank swap directory, the async I/O handle, and integrity checks of each file.

Layout (DeepSpeed-like): `<nvme_path>/zero_stage_3/rank<r>/params/param_<ds_id>.swp` for parameter shards
and `<nvme_path>/zero_stage_3/rank<r>/optimizer/tile<k>.<key>.swp` for the fp32 master and optimizer state
of each sub-group. A second swapper of the same kind in one process gets `params.1`, `optimizer.1`, ... A
directory is emptied when a swapper takes it and removed when the swapper is garbage collected.

[Note: integrity]
Every file the swappers write is recorded with its byte size and a checksum of the bytes written (a
wrapping 64-bit sum of the data read as integers: one vectorised pass, ~memory bandwidth; on the swap
paths the aio op's worker threads compute it as each piece of a request lands, `checksum=True`, so the
training thread never passes over the data again). Before a read
the file's size is checked (a truncated file is reported before any byte is used); after the read the
checksum is compared (a file overwritten with other bytes is reported). Either raises `NVMeSwapError`
naming the file and the tensor; the values are never used.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ds_ops.aio import AioError, AsyncIOHandle

if TYPE_CHECKING:
    from ds_ops.aio import AioConfig

logger = logging.getLogger(__name__)

__all__ = [
    "NVMeSwapError",
    "SwapFile",
    "checksum",
    "claim_finalizer",
    "dtype_word",
    "io_failure",
    "make_aio_handle",
    "prepare_swap_dir",
    "release_swap_dir",
]

_IN_USE: set[str] = set()
_PROBE_BYTES = 4096


class NVMeSwapError(OSError):
    """An NVMe swap file could not be written or read back intact (disk full, short read, corruption)."""


def make_aio_handle(aio_config: Mapping[str, Any] | AioConfig | None) -> AsyncIOHandle:
    """An `AsyncIOHandle` from the top-level `aio` section (a dict or `ds_ops.AioConfig`; None: defaults)."""
    from ds_ops.aio import AioConfig  # pydantic: loaded when NVMe offload is configured, not at import

    if aio_config is None or isinstance(aio_config, (AioConfig, Mapping)):
        return AsyncIOHandle.from_config(aio_config if aio_config is not None else {})  # validated as `aio.<key>`
    raise TypeError(
        f"aio_config must be the `aio` config section (a dict or ds_ops.AioConfig) or None, got "
        f"{type(aio_config).__name__}"
    )


def _refuse(key: str, path: Path, reason: str) -> ValueError:
    return ValueError(
        f"{key}={str(path)!r}: {reason}; point it at an existing, writable directory on a fast local disk (NVMe)"
    )


def prepare_swap_dir(nvme_path: str | os.PathLike[str] | None, *, key: str, rank: int, kind: str) -> Path:
    """Create (and check) this rank's swap directory for `kind` ("params" or "optimizer").

    Checks that `nvme_path` exists, is a directory, and takes a small write, so that a bad path fails
    before any training. The directory is reserved for the caller until `release_swap_dir` (or the
    finalizer registered by `claim_finalizer`).

    Args:
        nvme_path: the configured `nvme_path`.
        key: the config key for messages (`zero_optimization.offload_param.nvme_path`).
        rank: the global rank (one subdirectory per rank).
        kind: the swapper kind.

    Raises:
        ValueError: the path is unset, missing, not a directory, or not writable.
    """
    if nvme_path is None:
        raise ValueError(f'{key} is not set; device "nvme" needs a directory on a fast local disk')
    root = Path(nvme_path)
    if not root.exists():
        raise _refuse(key, root, "the directory does not exist")
    if not root.is_dir():
        raise _refuse(key, root, "it is not a directory")
    base = root / "zero_stage_3" / f"rank{rank}"
    n = 0
    while str(base / (kind if n == 0 else f"{kind}.{n}")) in _IN_USE:
        n += 1
    path = base / (kind if n == 0 else f"{kind}.{n}")
    try:
        if path.exists():
            shutil.rmtree(path)  # ours: swap files of an earlier run
        path.mkdir(parents=True)
        probe = path / ".probe"
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            if os.write(fd, b"\0" * _PROBE_BYTES) != _PROBE_BYTES:
                raise OSError(errno.ENOSPC, "short write")
        finally:
            os.close(fd)
        probe.unlink()
    except OSError as err:
        raise _refuse(key, root, f"cannot create swap files under it ({err.strerror or err})") from None
    _IN_USE.add(str(path))
    return path


def release_swap_dir(path: Path) -> None:
    """Remove a swap directory and free its name (the swapper is gone)."""
    _IN_USE.discard(str(path))
    shutil.rmtree(path, ignore_errors=True)


def claim_finalizer(owner: object, path: Path) -> None:
    """Remove `path` when `owner` is garbage collected (or at interpreter exit)."""
    weakref.finalize(owner, release_swap_dir, path)


def dtype_word(dtype: torch.dtype) -> str:
    """ "fp32", "bf16", "fp16" (what messages call a swap file's values)."""
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


def checksum(tensor: torch.Tensor) -> int:
    """A wrapping 64-bit sum of `tensor`'s bytes read as little 8-byte words from its first byte (plus the
    trailing bytes): independent of where the tensor lies in memory, cheap, detects changed or zeroed data.

    A tensor whose first byte is not 8-byte aligned in its storage is summed through an aligned copy.
    """
    flat = tensor.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    raw = flat.view(torch.uint8)
    bulk_bytes = raw.numel() // 8 * 8
    bulk = raw[:bulk_bytes]
    if (flat.storage_offset() * flat.element_size()) % 8:
        bulk = bulk.clone()
    total = int(bulk.view(torch.int64).sum()) if bulk_bytes else 0
    if bulk_bytes < raw.numel():
        total += int(raw[bulk_bytes:].sum(dtype=torch.int64))
    return total & ((1 << 64) - 1)


@dataclass
class SwapFile:
    """One swap file and what was last written to it.

    Attributes:
        path: the file.
        label: the tensor it holds, for messages ("shard of parameter 'layers.0.weight'").
        nbytes: bytes written (0: never written).
        digest: `checksum` of the bytes written.
    """

    path: Path
    label: str
    nbytes: int = 0
    digest: int = 0

    def recorded(self, tensor: torch.Tensor, digest: int | None = None) -> None:
        """The write of `tensor` completed: check the file's size, remember the size and checksum.

        `digest`: the checksum the aio workers computed while writing (`checksum=True`); None: computed here.
        """
        nbytes = tensor.numel() * tensor.element_size()
        try:
            size = os.stat(self.path).st_size
        except OSError as err:
            size, reason = -1, err.strerror
        else:
            reason = f"{size} bytes on disk"
        if size < nbytes:
            self.nbytes = 0
            raise NVMeSwapError(
                f"NVMe swap: write of {self.label} ({self.path}) failed: {nbytes} bytes written, "
                f"{reason} (disk full or over a file-size limit: free space under nvme_path or "
                "point it at a larger disk)"
            )
        self.nbytes = nbytes
        self.digest = checksum(tensor) if digest is None else digest

    def check_before_read(self, nbytes: int) -> None:
        """Refuse to read a file that was never written, is missing, or has the wrong size."""
        if self.nbytes == 0 or nbytes != self.nbytes:
            raise NVMeSwapError(
                f"NVMe swap: {self.label} has no valid swap file to read {nbytes} bytes from "
                f"({self.path}; {self.nbytes} bytes were written)"
            )
        try:
            size = os.stat(self.path).st_size
        except OSError as err:
            raise NVMeSwapError(
                f"NVMe swap: the swap file of {self.label} is gone ({self.path}: "
                f"{err.strerror}); it was deleted while training ran"
            ) from None
        if size < self.nbytes:
            raise NVMeSwapError(
                f"NVMe swap: the swap file of {self.label} is truncated ({self.path}: {size} bytes, "
                f"{self.nbytes} were written); the run cannot continue from it"
            )

    def verify(self, tensor: torch.Tensor, digest: int | None = None) -> None:
        """Compare what was read into `tensor` with what was written (`digest`: computed by the aio workers
        during the read; None: computed here)."""
        if (checksum(tensor) if digest is None else digest) != self.digest:
            raise NVMeSwapError(
                f"NVMe swap: the swap file of {self.label} is corrupted ({self.path}: its "
                f"{self.nbytes} bytes differ from those written); the run cannot continue from it"
            )


def io_failure(err: AioError, files: list[SwapFile], op: str) -> NVMeSwapError:
    """An `NVMeSwapError` naming the file(s) of a failed batch of requests and the tensors they hold."""
    text = str(err)
    named = [f for f in files if str(f.path) in text] or files
    what = "; ".join(f"{f.label} ({f.path})" for f in named[:4])
    more = f" and {len(named) - 4} more" if len(named) > 4 else ""
    hint = (
        " (disk full or over a file-size limit: free space under nvme_path or point it at a larger disk)"
        if op == "write"
        else ""
    )
    return NVMeSwapError(f"NVMe swap: {op} of {what}{more} failed: {text}{hint}")
