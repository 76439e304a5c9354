"""`deepspeed.runtime.zero` for migrated scripts: ds-zero's API (`Init`, `GatheredParameters`...) under that path.

Everything ds-zero exports, looked up on ds-zero itself (the same objects as `ds_engine.zero`);
`runtime.zero.partition_parameters` is DeepSpeed's module of the stage-3 construction API. Needs the
`zero` extra: without ds-zero, importing this package raises ImportError naming
`pip install 'ds-engine[zero]'`.
"""

from __future__ import annotations

from ds_engine._reexport import optional_reexport

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.runtime.zero", "ds_zero", extra="zero", feature="ds_engine.runtime.zero (deepspeed.runtime.zero, ZeRO)"
)
