"""`deepspeed.runtime.sequence_parallel.parallel_state_sp`: ds-parallel's module-level ALST mpu."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ds_engine._reexport import optional_reexport

if TYPE_CHECKING:  # names are looked up at run time; type checkers see ds_parallel's own
    from ds_parallel.parallel_state_sp import *  # noqa: F403

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.runtime.sequence_parallel.parallel_state_sp",
    "ds_parallel.parallel_state_sp",
    extra="parallel",
    feature="ds_engine.runtime.sequence_parallel.parallel_state_sp (the ALST mpu)",
)
