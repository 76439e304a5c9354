"""`deepspeed.io`: DeepNVMe's file writers for `torch.save`, DeepSpeed's module path over `ds_ops.fast_io`.

`ds_ops.io` and `ds_ops.nvme` only lay out DeepSpeed 0.19.8's module names and re-export ds-ops' own
objects; the `deepspeed` distribution aliases `deepspeed.io`/`deepspeed.nvme` to them. ds's code imports
`ds_ops.fast_io` and the `nvme_*` modules, never these.

writer = FastFileWriter(path, FastFileWriterConfig(dnvme_handle=aio_handle(), pinned_tensor=buffer))
torch.save(state, writer)
writer.close()
"""

from __future__ import annotations

from ds_ops.fast_io import FastFileWriter, FastFileWriterConfig, MockFileWriter, PyFileWriter

__all__ = ["FastFileWriter", "FastFileWriterConfig", "MockFileWriter", "PyFileWriter"]
