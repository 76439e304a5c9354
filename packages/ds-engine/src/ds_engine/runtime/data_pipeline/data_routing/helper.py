"""`deepspeed.runtime.data_pipeline.data_routing.helper`: wrapping a model for random-LTD and saving it without."""

from __future__ import annotations

from ds_engine._data.ltd_helpers import (
    convert_to_random_ltd,
    remove_random_ltd_state_dict,
    save_without_random_ltd,
)

__all__ = ["convert_to_random_ltd", "remove_random_ltd_state_dict", "save_without_random_ltd"]
