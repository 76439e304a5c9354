"""`deepspeed.module_inject.autotp_config`: configurable AutoTP (regex layer specs, presets).

`AutoTPConfig`, `TPLayerSpec`, `PartitionType`, `AutoTPPresets` and `merge_autotp_configs` are
ds-parallel's (`ds_parallel.tensor`), what `tensor_parallel.partition_config` / `preset_model` are read
into. Needs the `parallel` extra: without ds-parallel, importing this module raises ImportError naming
`pip install 'ds-engine[parallel]'`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ds_engine._reexport import optional_reexport

if TYPE_CHECKING:  # names are looked up at run time; type checkers see ds_parallel's own
    from ds_parallel.tensor import (  # noqa: F401
        AutoTPConfig,
        AutoTPPresets,
        PartitionType,
        TPLayerSpec,
        merge_autotp_configs,
    )

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.module_inject.autotp_config",
    "ds_parallel.tensor",
    extra="parallel",
    feature="ds_engine.module_inject.autotp_config (deepspeed.module_inject.autotp_config, configurable AutoTP)",
    names=("AutoTPConfig", "AutoTPPresets", "PartitionType", "TPLayerSpec", "merge_autotp_configs"),
)
