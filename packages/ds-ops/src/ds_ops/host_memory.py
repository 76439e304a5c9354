"""Host memory in transparent huge pages, for large buffers that are streamed end to end: CPU
optimizer state and the async I/O op's locked buffers.

[Note: huge pages] With 4 KiB pages a pass over hundreds of MiB misses the TLB every 4 KiB, and an
O_DIRECT transfer pins and maps every page of the caller's buffer. Measured on this project's virtual
machines (2 vCPUs, virtio disk): 128 MiB O_DIRECT reads into 4 KiB-page memory at 0.6-0.9 GB/s, into
2 MiB pages at 2.1-3.0 GB/s; the Adam-pattern loop over four 200 MB arrays (benchmarks/cpu_adam.py's
roofline) 8% faster with 1 thread, 4% with 2, when the arrays sit in 2 MiB pages (paired runs).
torch's CPU allocator gives 4 KiB pages unless THP_MEM_ALLOC_ENABLE is set, and memory it already
faulted in stays so, hence a fresh private mapping per buffer, 2 MiB-aligned and marked
MADV_HUGEPAGE. The mark takes effect where /sys/kernel/mm/transparent_hugepage/enabled is `madvise`
or `always` and is a no-op where it is `never` (and where Python's mmap has no MADV_HUGEPAGE, off
Linux: the mapping is still 2 MiB-aligned); below one huge page, buffers come from torch's allocator.
"""

from __future__ import annotations

import mmap

import torch

#: A transparent huge page on x86-64 and most arm64 kernels.
HUGE_PAGE = 2 << 20


def huge_page_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor of `numel` zeros, in transparent huge pages when it spans at least one.

    From 2 MiB up the first byte is 2 MiB-aligned; below, this is `torch.zeros`. The memory lives as
    long as any view of the tensor does.
    """
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    if nbytes < HUGE_PAGE:
        return torch.zeros(numel, dtype=dtype)
    # Anonymous memory reads as zeros and nothing is touched here: each page becomes a huge page
    # (or a 4 KiB one, when the kernel has none free) as it is first written.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` alive as long as any view of it
    shift = (-raw.data_ptr()) % HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, shift, nbytes)
    except (AttributeError, OSError):  # no THP here (off Linux, or a kernel without it): small pages, aligned
        pass
    return raw[shift : shift + nbytes].view(dtype)
