"""`deepspeed.nvme.torch_io`: `ds_io --engine torch_io`'s engine (ds-ops' `ds_ops.nvme_torch_io`)."""

from __future__ import annotations

from ds_ops.nvme_torch_io import TorchIOEngine

TorchIO_Engine = TorchIOEngine  # noqa: N816 - DeepSpeed's name
"""DeepSpeed's name: `torch.save` of the buffer to the task's file, timed (writes only)."""

__all__ = ["TorchIO_Engine"]
