"""`deepspeed.io`: DeepNVMe's file writers for `torch.save` (ds-ops' `ds_ops.fast_io`).

writer = FastFileWriter(path, FastFileWriterConfig(dnvme_handle=aio_handle(), pinned_tensor=buffer))
torch.save(state, writer)
writer.close()
"""

from __future__ import annotations

from ds_ops.fast_io import FastFileWriter, FastFileWriterConfig, MockFileWriter, PyFileWriter

__all__ = ["FastFileWriter", "FastFileWriterConfig", "MockFileWriter", "PyFileWriter"]
