"""`deepspeed.io.mock_file_writer`: counts what `torch.save` would write, writes nothing (ds-ops')."""

from __future__ import annotations

from ds_ops.fast_io import MockFileWriter

__all__ = ["MockFileWriter"]
