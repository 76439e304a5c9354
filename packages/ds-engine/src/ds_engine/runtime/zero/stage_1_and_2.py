"""`deepspeed.runtime.zero.stage_1_and_2`: the ZeRO stage 1/2 optimizer and its memory estimators, ds-zero's.

`DeepSpeedZeroOptimizer` is the class `engine.optimizer` is under ZeRO-1/2 (for `isinstance` checks);
`estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node, num_nodes)` and its
`_all_cold` / plain variants print or return the memory a ZeRO-2 run needs. Needs the `zero` extra:
without ds-zero, importing this module raises ImportError naming `pip install 'ds-engine[zero]'`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ds_engine._reexport import optional_reexport

if TYPE_CHECKING:  # names are looked up at run time; type checkers see ds_zero's own
    from ds_zero import *  # noqa: F403

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.runtime.zero.stage_1_and_2",
    "ds_zero",
    extra="zero",
    feature="ds_engine.runtime.zero.stage_1_and_2 (deepspeed.runtime.zero.stage_1_and_2, ZeRO-1/2)",
    names=(
        "DeepSpeedZeroOptimizer",
        "estimate_zero2_model_states_mem_needs",
        "estimate_zero2_model_states_mem_needs_all_cold",
        "estimate_zero2_model_states_mem_needs_all_live",
    ),
)
