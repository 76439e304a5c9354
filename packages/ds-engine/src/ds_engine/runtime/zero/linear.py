"""`deepspeed.runtime.zero.linear`: DeepSpeed's stage-3 linear (`zero3_linear_wrap`), ds-zero's.

Needs the `zero` extra: without ds-zero, importing this module raises ImportError naming
`pip install 'ds-engine[zero]'`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ds_engine._reexport import optional_reexport

if TYPE_CHECKING:  # names are looked up at run time; type checkers see ds_zero's own
    from ds_zero import *  # noqa: F403

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.runtime.zero.linear",
    "ds_zero",
    extra="zero",
    feature="ds_engine.runtime.zero.linear (deepspeed.runtime.zero.linear, ZeRO-3)",
    names=("LinearFunctionForZeroStage3", "zero3_linear_wrap"),
)
