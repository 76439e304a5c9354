"""DeepSpeed 0.19.8's per-family gradient reductions for AutoEP folded with AutoTP, as a classification.

DeepSpeed's folded backward sums the gathered expert outputs' gradient over the tensor-parallel lanes, so
each family's gradient comes out scaled by `tp_size` or partial, and its engine corrects each family after
backward: the replicated router and dense parameters are averaged over the lanes ("average"), a router whose
tokens are split over the lanes would be summed ("sum"), routed experts are divided by `tp_size`
("expert_tp_cancel"), and parameters already cut by tensor parallelism, or experts without folding, are left
alone ("skip").

ds's folded dispatch (`_fold`) produces the exact gradient on every lane instead, so ds's engine applies none
of these corrections. The classification is kept, with DeepSpeed's parameter marks, because it is part of
DeepSpeed's API and names the family of each parameter the same way the checkpoint record does.
"""

from __future__ import annotations

from typing import Any

__all__ = [
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
]

AUTOEP_FOLDING_PARAM_FAMILY_ATTR = "ds_autoep_folding_param_family"
AUTOEP_FOLDING_ROUTER_GATE_REPLICATED_PARAM = "router_gate_replicated"
AUTOEP_FOLDING_ROUTER_GATE_PARTIAL_PARAM = "router_gate_partial"
AUTOEP_FOLDING_SP_SHARDED_LAYERNORM_PARAM = "sp_sharded_layernorm"
AUTOEP_FOLDING_GRAD_REDUCE_SKIP = "skip"
AUTOEP_FOLDING_GRAD_REDUCE_SUM = "sum"
AUTOEP_FOLDING_GRAD_REDUCE_AVERAGE = "average"
AUTOEP_FOLDING_GRAD_REDUCE_EXPERT_TP_CANCEL = "expert_tp_cancel"


def mark_autoep_folding_router_parameter(param: Any) -> None:
    """Mark a router parameter run alike on every lane (the folded router): DeepSpeed averages it."""
    setattr(param, AUTOEP_FOLDING_PARAM_FAMILY_ATTR, AUTOEP_FOLDING_ROUTER_GATE_REPLICATED_PARAM)


def mark_autoep_folding_partial_router_parameter(param: Any) -> None:
    """Mark a router parameter whose tokens are split over the lanes (each holds a partial): summed."""
    setattr(param, AUTOEP_FOLDING_PARAM_FAMILY_ATTR, AUTOEP_FOLDING_ROUTER_GATE_PARTIAL_PARAM)


def mark_autoep_folding_sp_sharded_layernorm_parameter(param: Any) -> None:
    """Mark a norm that sees a sequence shard per lane: summed when the lanes split the sequence ("sp")."""
    setattr(param, AUTOEP_FOLDING_PARAM_FAMILY_ATTR, AUTOEP_FOLDING_SP_SHARDED_LAYERNORM_PARAM)


def autoep_folding_gradient_reduction_strategy(folding_spec: Any, param: Any, *, param_name: str | None = None) -> str:
    """DeepSpeed's correction of `param`'s gradient over the lanes of `folding_spec` (see the module docstring).

    An explicit mark wins; an unmarked parameter named `.router.` counts as the replicated router.
    """
    if folding_spec is None or getattr(folding_spec, "tp_size", 1) <= 1:
        return AUTOEP_FOLDING_GRAD_REDUCE_SKIP
    if getattr(param, "model_parallel", False) or getattr(param, "tensor_model_parallel", False):
        return AUTOEP_FOLDING_GRAD_REDUCE_SKIP
    if hasattr(param, "allreduce") and not param.allreduce:  # a routed expert
        return AUTOEP_FOLDING_GRAD_REDUCE_EXPERT_TP_CANCEL
    family = getattr(param, AUTOEP_FOLDING_PARAM_FAMILY_ATTR, None)
    if family is None and param_name is not None and ".router." in param_name:
        family = AUTOEP_FOLDING_ROUTER_GATE_REPLICATED_PARAM
    split_tokens = getattr(folding_spec, "mp_mode", "tp") in ("tp", "sp")
    if family == AUTOEP_FOLDING_ROUTER_GATE_PARTIAL_PARAM:
        return AUTOEP_FOLDING_GRAD_REDUCE_SUM if split_tokens else AUTOEP_FOLDING_GRAD_REDUCE_AVERAGE
    if family == AUTOEP_FOLDING_SP_SHARDED_LAYERNORM_PARAM and getattr(folding_spec, "mp_mode", "tp") == "sp":
        return AUTOEP_FOLDING_GRAD_REDUCE_SUM
    return AUTOEP_FOLDING_GRAD_REDUCE_AVERAGE
