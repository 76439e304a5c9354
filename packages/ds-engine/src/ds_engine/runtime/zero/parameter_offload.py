"""`deepspeed.runtime.zero.parameter_offload`: stage-3 parameter management without an optimizer, ds-zero's.

`DeepSpeedZeRoOffload` (gather/release hooks for evaluation or a custom loop), `ZeROOrderedDict` (the
`_parameters` dict that gathers a released parameter read during forward) and `ensure_zero_ordered_dict`.
Needs the `zero` extra: without ds-zero, importing this module raises ImportError naming
`pip install 'ds-engine[zero]'`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ds_engine._reexport import optional_reexport

if TYPE_CHECKING:  # names are looked up at run time; type checkers see ds_zero's own
    from ds_zero import *  # noqa: F403

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.runtime.zero.parameter_offload",
    "ds_zero",
    extra="zero",
    feature="ds_engine.runtime.zero.parameter_offload (deepspeed.runtime.zero.parameter_offload, ZeRO-3)",
    names=("DeepSpeedZeRoOffload", "ZeROOrderedDict", "ensure_zero_ordered_dict"),
)
