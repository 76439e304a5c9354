"""`deepspeed.runtime.zero.stage3`: the stage-3 optimizer and `unwrap_model_for_generation`, ds-zero's.

Needs the `zero` extra: without ds-zero, importing this module raises ImportError naming
`pip install 'ds-engine[zero]'`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ds_engine._reexport import optional_reexport

if TYPE_CHECKING:  # names are looked up at run time; type checkers see ds_zero's own
    from ds_zero import *  # noqa: F403

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.runtime.zero.stage3",
    "ds_zero",
    extra="zero",
    feature="ds_engine.runtime.zero.stage3 (deepspeed.runtime.zero.stage3, ZeRO-3)",
    names=("DeepSpeedZeroOptimizer_Stage3", "unwrap_model_for_generation"),
)
