"""`deepspeed.module_inject.auto_ep_config`: AutoEP's DeepSpeed-shaped settings object, parser and checks.

ds-parallel's `ds_parallel.autoep`; needs the `parallel` extra.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ds_engine._reexport import optional_reexport

if TYPE_CHECKING:  # names are looked up at run time; type checkers see ds_parallel's own
    pass

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.module_inject.auto_ep_config",
    "ds_parallel.autoep",
    extra="parallel",
    feature="ds_engine.module_inject.auto_ep_config (deepspeed.module_inject.auto_ep_config, AutoEP)",
    names=[
        "PRESET_MODELS",
        "AutoEPConfig",
        "MoELayerSpec",
        "MoEModelPreset",
        "fill_autoep_config_from_hf",
        "parse_autoep_config",
        "validate_autoep_config",
        "validate_autoep_post_detection",
    ],
)
