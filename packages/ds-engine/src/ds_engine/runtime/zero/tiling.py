"""`deepspeed.runtime.zero.tiling`: `TiledLinear` (a linear cut into tiles ZeRO-3 gathers one at a time), ds-zero's.

Needs the `zero` extra: without ds-zero, importing this module raises ImportError naming
`pip install 'ds-engine[zero]'`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ds_engine._reexport import optional_reexport

if TYPE_CHECKING:  # names are looked up at run time; type checkers see ds_zero's own
    from ds_zero import *  # noqa: F403

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.runtime.zero.tiling",
    "ds_zero",
    extra="zero",
    feature="ds_engine.runtime.zero.tiling (deepspeed.runtime.zero.tiling, TiledLinear)",
    names=("TiledLinear", "TiledLinearReturnBias"),
)
