"""`deepspeed.module_inject.auto_ep_folding`: AutoEP+AutoTP folding: the rank layout of a stage and its checks.

ds-parallel's `ds_parallel.autoep`; needs the `parallel` extra.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ds_engine._reexport import optional_reexport

if TYPE_CHECKING:  # names are looked up at run time; type checkers see ds_parallel's own
    pass

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.module_inject.auto_ep_folding",
    "ds_parallel.autoep",
    extra="parallel",
    feature="ds_engine.module_inject.auto_ep_folding (deepspeed.module_inject.auto_ep_folding, AutoEP)",
    names=[
        "AUTOEP_FOLDING_GRAD_REDUCE_AVERAGE",
        "AUTOEP_FOLDING_GRAD_REDUCE_EXPERT_TP_CANCEL",
        "AUTOEP_FOLDING_GRAD_REDUCE_SKIP",
        "AUTOEP_FOLDING_GRAD_REDUCE_SUM",
        "AUTOEP_FOLDING_PARAM_FAMILY_ATTR",
        "AUTOEP_FOLDING_ROUTER_GATE_PARTIAL_PARAM",
        "AUTOEP_FOLDING_ROUTER_GATE_REPLICATED_PARAM",
        "AUTOEP_FOLDING_SP_SHARDED_LAYERNORM_PARAM",
        "autoep_folding_gradient_reduction_strategy",
        "mark_autoep_folding_partial_router_parameter",
        "mark_autoep_folding_router_parameter",
        "mark_autoep_folding_sp_sharded_layernorm_parameter",
        "FoldingGroupHandles",
        "FoldingGroupTables",
        "ParallelFoldingSpec",
        "assert_group_matches_spec",
        "build_folding_spec",
        "expected_folding_group_tables",
        "local_folding_ranks",
        "validate_folding_global",
    ],
)
