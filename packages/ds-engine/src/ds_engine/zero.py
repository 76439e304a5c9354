"""`deepspeed.zero` for migrated scripts: `zero.Init`, `GatheredParameters`, `register_external_parameter`...

Everything ds-zero exports, looked up on ds-zero itself. Needs the `zero` extra: without ds-zero,
importing this module raises ImportError naming `pip install 'ds-engine[zero]'`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ds_engine._reexport import optional_reexport

if TYPE_CHECKING:  # names are looked up at run time; type checkers see ds_zero's own
    from ds_zero import *  # noqa: F403

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.zero", "ds_zero", extra="zero", feature="ds_engine.zero (deepspeed.zero, ZeRO)"
)
