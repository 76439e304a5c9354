"""`deepspeed.runtime.domino.async_linear`: ds-parallel's `ds_parallel.domino.async_linear`.

Needs the `parallel` extra.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ds_engine._reexport import optional_reexport

if TYPE_CHECKING:  # names are looked up at run time; type checkers see ds_parallel's own
    from ds_parallel.domino.async_linear import *  # noqa: F403

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.runtime.domino.async_linear",
    "ds_parallel.domino.async_linear",
    extra="parallel",
    feature="ds_engine.runtime.domino.async_linear (deepspeed.runtime.domino.async_linear, Domino)",
)
