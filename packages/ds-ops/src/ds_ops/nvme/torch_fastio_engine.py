"""`deepspeed.nvme.torch_fastio_engine`: `ds_io --engine torch_fastio`'s engine (ds-ops' `ds_ops.nvme_torch_io`)."""

from __future__ import annotations

from ds_ops.nvme_torch_io import TorchFastIOEngine

Torch_FastIO_Engine = TorchFastIOEngine  # noqa: N816 - DeepSpeed's name
"""DeepSpeed's name: `torch.save` of the buffer through a `FastFileWriter`, timed (writes only)."""

__all__ = ["Torch_FastIO_Engine"]
