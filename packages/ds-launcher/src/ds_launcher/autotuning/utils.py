"""DeepSpeed's `deepspeed.autotuning.utils`: the nested-dict helpers the autotuner uses."""

from __future__ import annotations

from ds_launcher._autotuning.scheduler import get_val_by_key, set_val_by_key

__all__ = ["get_val_by_key", "set_val_by_key"]
