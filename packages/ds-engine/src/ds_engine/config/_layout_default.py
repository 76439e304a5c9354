"""The checkpoint layout a config that does not set `checkpoint.layout` gets: ds's, or DeepSpeed's under `deepspeed`.

`import ds_engine` saves in ds's own layout unless the config asks otherwise. The `deepspeed`
compatibility distribution serves DeepSpeed's users, whose tools (DeepSpeed's `zero_to_fp32.py`,
Hugging Face's and Lightning's helpers) expect DeepSpeed's files: importing it makes DeepSpeed's layout
the default for engines initialized afterwards in that process, wherever that layout can hold the job
(`ds_engine._checkpoint.deepspeed_layout.resolve_checkpoint_layout`, which logs the fallback otherwise). One
setting per process, read once by each `initialize()`; an explicit `checkpoint.layout` always wins.
"""

from __future__ import annotations

import logging
from typing import Literal

__all__ = ["CheckpointLayout", "default_checkpoint_layout", "set_default_checkpoint_layout"]

logger = logging.getLogger(__name__)

CheckpointLayout = Literal["ds", "deepspeed"]
_LAYOUTS = ("ds", "deepspeed")
_default: CheckpointLayout = "ds"


def set_default_checkpoint_layout(layout: CheckpointLayout) -> None:
    """Make `layout` the checkpoint layout of engines whose config leaves `checkpoint.layout` unset.

    Raises:
        ValueError: `layout` is not "ds" or "deepspeed".
    """
    global _default
    if layout not in _LAYOUTS:
        raise ValueError(f"set_default_checkpoint_layout: layout must be 'ds' or 'deepspeed', got {layout!r}")
    _default = layout


def default_checkpoint_layout() -> CheckpointLayout:
    """The layout an unset `checkpoint.layout` resolves to (before what the job allows is checked)."""
    return _default
