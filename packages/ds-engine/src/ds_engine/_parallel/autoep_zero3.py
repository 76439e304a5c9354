"""DeepSpeed 0.19.8's gate for AutoEP at ZeRO stage 3 (its `_validate_zero3_moe_compatibility`), by config key.

Expert parameters are partitioned over their expert-data-parallel group (`_step.moe_zero3`); what partitions
or reduces over other groups cannot take them, so DeepSpeed refuses it, and so does ds: hpZ secondary groups,
MiCS shards, quantized gradients (qgZ / LoCo) and expert tensor parallelism. AutoTP and sequence parallelism
with AutoEP are refused for every stage (`_parallel.autoep._check_layout`), native MoE layers at stage 3 by
the assembly (`_step.moe_zero3.check_zero3_moe`).
"""

from __future__ import annotations

from typing import Any

from ds_engine.config._expert_parallel_section import ExpertParallelConfig

__all__ = ["check_autoep_zero3"]

_PREFIX = "expert_parallel.enabled with zero_optimization.stage=3"


def check_autoep_zero3(section: ExpertParallelConfig, zero_config: Any) -> None:
    """Refuse the stage-3 combinations DeepSpeed's AutoEP gate refuses, naming the key (before any collective).

    Raises:
        ValueError: hpZ, MiCS, quantized gradients or LoCo set, or `expert_tensor_parallel_size` != 1.
    """
    if section.expert_tensor_parallel_size != 1:
        raise ValueError(
            f"{_PREFIX} only supports expert_parallel.expert_tensor_parallel_size=1 "
            f"(got {section.expert_tensor_parallel_size}), as in DeepSpeed"
        )
    if zero_config is None:
        return
    hpz = int(getattr(zero_config, "zero_hpz_partition_size", 1))
    if hpz > 1:
        raise ValueError(
            f"{_PREFIX} does not support hpZeRO secondary tensor groups "
            f"(zero_optimization.zero_hpz_partition_size={hpz}), as in DeepSpeed; set it to 1"
        )
    mics = int(getattr(zero_config, "mics_shard_size", -1))
    if mics > 0:
        raise ValueError(
            f"{_PREFIX} does not support MiCS (zero_optimization.mics_shard_size={mics}), as in DeepSpeed; "
            "remove the key"
        )
    if getattr(zero_config, "zero_quantized_gradients", False) or getattr(zero_config, "zeropp_loco_param", None):
        raise ValueError(
            f"{_PREFIX} does not support quantized gradients (zero_optimization.zero_quantized_gradients / "
            "zeropp_loco_param), as in DeepSpeed; remove them"
        )
