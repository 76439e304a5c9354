"""AutoEP at ZeRO stage 3: which MoE models stage 3 takes, and where each parameter is partitioned.

DeepSpeed 0.19.8 trains AutoEP layers at stage 3 (not its native `deepspeed.moe.layer.MoE`): an expert tensor
holds only this expert-parallel rank's experts, which are replicated across the expert-data-parallel group,
so that is the group it is split over (its "placement family", `autoep_expert`); every other parameter is
split over the data-parallel group (`replicated`). The marks are DeepSpeed's parameter attributes, read by
ds-zero when it partitions (`ds_zero._params.placement`). Gradients of experts are reduce-scattered over the
expert-data-parallel group and averaged over the data-parallel world, as at ZeRO 1/2 (`_step.moe`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

import ds_comm
from ds_engine._plan.dist_info import DistInfo
from ds_engine._step.moe import MoeWiring, is_expert_param

__all__ = ["check_zero3_moe", "mark_zero3_placement"]

AUTOEP_EXPERT = "autoep_expert"
REPLICATED = "replicated"


def check_zero3_moe(wiring: MoeWiring) -> None:
    """Stage 3 takes AutoEP layers only (DeepSpeed's `_validate_zero3_moe_compatibility`).

    Raises:
        ValueError: a native DeepSpeed MoE layer (`deepspeed.moe.layer.MoE`) in the model.
    """
    native = [layer.prefix for layer in wiring.layers if not layer.fused_experts]
    if native:
        raise ValueError(
            "zero_optimization.stage=3: Native DeepSpeed MoE is not supported with ZeRO Stage 3 "
            f"(deepspeed.moe.layer.MoE layers {native[:3]}, refused as DeepSpeed 0.19.8 does); use AutoEP "
            "(expert_parallel.enabled) or choose ZeRO stage 1/2, or at stage 3 a mixture-of-experts block of plain "
            "modules flagged as a ZeRO-3 leaf (zero_optimization.leaf_module or deepspeed.utils.set_z3_leaf_modules)"
        )


def mark_zero3_placement(module: nn.Module, wiring: MoeWiring, dist: DistInfo) -> None:
    """Give every parameter DeepSpeed's placement marks before ZeRO-3 partitions it (see the module docstring).

    Raises:
        ValueError: an AutoEP expert parameter already partitioned over another group (the model was built
            under `zero.Init` with the AutoEP layers in it; DeepSpeed refuses that too).
    """
    for name, p in module.named_parameters():
        if is_expert_param(p):
            family, group_name = AUTOEP_EXPERT, getattr(p, "group_name")  # noqa: B009 - set by the MoE layer
            group: Any = wiring.edp_groups[group_name]
        else:
            family, group_name, group = REPLICATED, None, dist.dp_group
        partitioned = getattr(p, "ds_process_group", None) if hasattr(p, "ds_id") else None
        if hasattr(p, "ds_id") and family == AUTOEP_EXPERT and not _same_group(partitioned, group):
            raise ValueError(
                f"expert_parallel.enabled: AutoEP expert parameter {name!r} was already partitioned by "
                "zero.Init over a non-expert process group; build the model outside zero.Init (AutoEP creates the "
                "expert parameters) or leave the MoE blocks unconverted inside it"
            )
        setattr(p, "ds_zero_placement_family", family)  # noqa: B010 - DeepSpeed's parameter attributes
        setattr(p, "ds_zero_partition_group_name", group_name)  # noqa: B010
        setattr(p, "ds_zero_partition_process_group", group)  # noqa: B010


def _same_group(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if a is None or b is None:
        return False
    return bool(ds_comm.get_all_ranks_from_group(a) == ds_comm.get_all_ranks_from_group(b))
