"""Host buffers for the async I/O op: page-aligned (pinned where CUDA is present, in huge pages
from 2 MiB up, see ds_ops.host_memory) tensors, and whether a directory's file system takes O_DIRECT."""

from __future__ import annotations

import errno
import os
import tempfile

import torch

from ds_ops.host_memory import HUGE_PAGE, huge_page_zeros

#: O_DIRECT alignment of memory, offsets and sizes the op uses (covers 512 B and 4 KiB devices).
ALIGNMENT = 4096


def aligned_tensor(numel: int, dtype: torch.dtype, *, pin: bool) -> torch.Tensor:
    """A 1-D tensor of `numel` elements whose first byte is on a 4096-byte boundary; from 2 MiB up,
    unpinned ones are 2 MiB-aligned in transparent huge pages (see ds_ops.host_memory).

    Over-allocates by one alignment unit and views the aligned part (the view keeps the whole
    allocation alive).

    Args:
        numel: number of elements (>= 1).
        dtype: element type.
        pin: allocate page-locked memory (needs CUDA); host-device copies from it are asynchronous.
    """
    itemsize = torch.empty(0, dtype=dtype).element_size()
    nbytes = numel * itemsize
    if not pin and nbytes >= HUGE_PAGE:
        return huge_page_zeros(numel, dtype)
    raw = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8, pin_memory=pin)
    shift = (-raw.data_ptr()) % ALIGNMENT
    return raw[shift : shift + nbytes].view(dtype)


def direct_io_allowed(path: str) -> bool:
    """Whether the file system holding `path` accepts O_DIRECT.

    Opens `path` with O_DIRECT when it is an existing file, else creates (and removes) a probe file
    in its directory, which is what a write request does.

    Raises:
        OSError: `path`'s directory cannot be opened or written (missing, not a directory, read-only).
    """
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    try:
        if os.path.isfile(path):
            os.close(os.open(path, os.O_RDONLY | flag))
            return True
        directory = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
        fd, probe = tempfile.mkstemp(prefix=".ds_aio_probe_", dir=directory)
        os.close(fd)
        try:
            os.close(os.open(probe, os.O_WRONLY | flag))
        finally:
            os.unlink(probe)
        return True
    except OSError as err:
        if err.errno == errno.EINVAL:
            return False
        raise
