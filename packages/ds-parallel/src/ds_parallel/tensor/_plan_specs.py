"""A Hugging Face tensor-parallel plan as DeepSpeed's regex layer specs (`TPLayerSpec`), one per entry.

`shard_model(..., tp_plan=...)` cuts by a plan directly (`resolve_plan`); this is the other spelling of
the same decision, for code that builds an `AutoTPConfig` from a plan (DeepSpeed's `TPPlanConverter`):
each entry becomes a spec whose one pattern is the entry's regex (`plan_regex`), so the spec matches the
weights the entry matches. Styles that keep the weight whole (`embedding_rowwise`,
`replicated_with_grad_allreduce`) become `SKIP` specs, the latter with `grad_allreduce`. A style outside
`PLAN_STYLES` refuses the whole plan: applying only the known entries could cut one half of a
column/row pair.
"""

from __future__ import annotations

from collections.abc import Mapping

from ds_parallel.tensor._partition_config import PartitionType, TPLayerSpec
from ds_parallel.tensor._plan import PLAN_STYLES, PlanStyle, plan_regex

__all__ = ["plan_to_layer_specs"]

#: style -> (partition type, gather_output, grad_allreduce)
_SPEC_OF: Mapping[PlanStyle, tuple[PartitionType, bool, bool]] = {
    PlanStyle.COLUMN: (PartitionType.COLUMN, False, False),
    PlanStyle.COLUMN_GATHER: (PartitionType.COLUMN, True, False),
    PlanStyle.ROW: (PartitionType.ROW, False, False),
    PlanStyle.KEEP: (PartitionType.SKIP, False, False),
    PlanStyle.REPLICATED_GRAD_ALLREDUCE: (PartitionType.SKIP, False, True),
}


def plan_to_layer_specs(plan: Mapping[str, str]) -> list[TPLayerSpec] | None:
    """One `TPLayerSpec` per plan entry, in plan order; None for an empty plan (nothing to go by).

    Raises:
        ValueError: a style outside `PLAN_STYLES` (all such styles named); nothing is converted.
    """
    if not plan:
        return None
    unsupported = sorted({style for style in plan.values() if str(style).lower() not in PLAN_STYLES})
    if unsupported:
        raise ValueError(
            f"Hugging Face tp_plan has unsupported partition style(s) {unsupported} (supported: "
            f"{', '.join(PLAN_STYLES)}); the plan is refused as a whole, since applying only the known entries "
            "could cut one half of a column/row pair: give tensor_parallel.partition_config for this model instead"
        )
    specs = []
    for pattern, style in plan.items():
        partition_type, gather_output, grad_allreduce = _SPEC_OF[PLAN_STYLES[style.lower()]]
        specs.append(
            TPLayerSpec(
                patterns=[plan_regex(pattern)],
                partition_type=partition_type,
                gather_output=gather_output,
                grad_allreduce=grad_allreduce,
            )
        )
    return specs
