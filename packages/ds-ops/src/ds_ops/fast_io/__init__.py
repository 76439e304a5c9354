"""Fast checkpoint file writing (DeepSpeed's `deepspeed.io`): `torch.save` through aligned buffers and the async I/O op.

    handle = AsyncIOHandle()
    buffer = handle.new_cpu_locked_tensor(64 << 20, torch.empty(0, dtype=torch.uint8))
    writer = FastFileWriter(path, FastFileWriterConfig(dnvme_handle=handle, pinned_tensor=buffer))
    torch.save(state, writer)
    writer.close()

`PyFileWriter` (a plain Python file) and `MockFileWriter` (counts, writes nothing) share the face and
the statistics, for comparison. `constants` holds the statistic names, `serial` the byte/tensor helpers.
"""

from __future__ import annotations

from ds_ops.fast_io._base import BaseFileWriter, MockFileWriter, PyFileWriter
from ds_ops.fast_io._fast_writer import FastFileWriter, FastFileWriterConfig
from ds_ops.fast_io._io_buffers import DoubleIOBuffer, SingleIOBuffer

__all__ = [
    "BaseFileWriter",
    "DoubleIOBuffer",
    "FastFileWriter",
    "FastFileWriterConfig",
    "MockFileWriter",
    "PyFileWriter",
    "SingleIOBuffer",
]
