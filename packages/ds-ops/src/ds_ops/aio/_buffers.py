"""Host buffers for the async I/O op: page-aligned (pinned where CUDA is present) tensors, and
whether a directory's file system takes O_DIRECT.

[Note: huge pages] An O_DIRECT transfer pins the caller's pages for the device and maps each one; with
4 KiB pages that per-page work, not the disk, bounds a large read. On this project's virtual machines
(2 vCPUs, virtio disk) 128 MiB O_DIRECT reads into 4 KiB-page memory ran at 0.6-0.9 GB/s and into
2 MiB transparent huge pages at 2.1 GB/s, with dd's 1.5-2 GB/s between them (benchmarks/aio.py). So a
buffer of at least one huge page is mapped fresh, aligned to 2 MiB and marked MADV_HUGEPAGE (which
takes effect where /sys/kernel/mm/transparent_hugepage/enabled is `madvise` or `always`, and is a no-op
where it is `never`)."""

from __future__ import annotations

import errno
import mmap
import os
import tempfile

import torch

#: O_DIRECT alignment of memory, offsets and sizes the op uses (covers 512 B and 4 KiB devices).
ALIGNMENT = 4096
#: A transparent huge page on x86-64 and most arm64 kernels; buffers this large get them (see the note).
HUGE_PAGE = 2 << 20


def aligned_tensor(numel: int, dtype: torch.dtype, *, pin: bool) -> torch.Tensor:
    """A 1-D tensor of `numel` elements whose first byte is on a 4096-byte boundary; from 2 MiB up,
    on a 2 MiB boundary in transparent huge pages where the kernel offers them (see [Note: huge pages]).

    Over-allocates by one alignment unit and views the aligned part (the view keeps the whole
    allocation alive).

    Args:
        numel: number of elements (>= 1).
        dtype: element type.
        pin: allocate page-locked memory (needs CUDA); host-device copies from it are asynchronous.
    """
    itemsize = torch.empty(0, dtype=dtype).element_size()
    nbytes = numel * itemsize
    if not pin and nbytes >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        return _huge_page_bytes(nbytes).view(dtype)
    raw = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8, pin_memory=pin)
    shift = (-raw.data_ptr()) % ALIGNMENT
    return raw[shift:shift + nbytes].view(dtype)


def _huge_page_bytes(nbytes: int) -> torch.Tensor:
    """`nbytes` bytes of a fresh private anonymous mapping, 2 MiB-aligned and marked MADV_HUGEPAGE.

    A fresh mapping, not the allocator's memory: pages the allocator already faulted in as 4 KiB
    stay 4 KiB. Nothing is touched here; pages become huge as they are first written.
    """
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` alive as long as any view of it
    shift = (-raw.data_ptr()) % HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, shift, nbytes - nbytes % ALIGNMENT)
    except OSError:  # a kernel without transparent huge pages: 4 KiB pages, still aligned
        pass
    return raw[shift:shift + nbytes]


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
