"""DeepSpeed-MoE: mixture-of-experts layers with expert parallelism.

`MoE` (`layer`) wraps `TopKGate` + `Experts` + the expert-parallel all-to-all (`sharded_moe`);
`utils` tells expert parameters apart for optimizers. Expert groups are named `ep_size_{N}` and are
views of the process mesh (`ds_parallel.groups`).
"""

from __future__ import annotations

from ds_parallel.moe._groups import ExpertGroups, create_expert_groups, get_expert_groups
from ds_parallel.moe.experts import Experts
from ds_parallel.moe.layer import MoE
from ds_parallel.moe.sharded_moe import MOELayer, TopKGate, top1gating, top2gating, topkgating
from ds_parallel.moe.utils import (
    configure_moe_param_groups,
    has_moe_layers,
    is_moe_param,
    is_moe_param_group,
    split_params_into_different_moe_groups_for_optimizer,
)

__all__ = [
    "ExpertGroups",
    "Experts",
    "MOELayer",
    "MoE",
    "TopKGate",
    "configure_moe_param_groups",
    "create_expert_groups",
    "get_expert_groups",
    "has_moe_layers",
    "is_moe_param",
    "is_moe_param_group",
    "split_params_into_different_moe_groups_for_optimizer",
    "top1gating",
    "top2gating",
    "topkgating",
]
