"""`deepspeed.module_inject.auto_ep_presets.registry`: the AutoEP presets by name and by Hugging Face model type.

ds-parallel's `ds_parallel.autoep`; needs the `parallel` extra.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ds_engine._reexport import optional_reexport

if TYPE_CHECKING:  # names are looked up at run time; type checkers see ds_parallel's own
    pass

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.module_inject.auto_ep_presets.registry",
    "ds_parallel.autoep",
    extra="parallel",
    feature="deepspeed.module_inject.auto_ep_presets.registry (AutoEP presets)",
    names=["PRESET_MODELS", "get_preset_adapter", "unsupported_preset_for_hf_model_type"],
    renames={"preset_name_for_hf_model_type": "preset_for_model_type"},
)
