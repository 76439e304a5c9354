"""What `"optimizer": {"type": "Muon"}` does at each ZeRO stage, as `explain` lines, and the one refusal.

Why here: the Muon choices (`per_head_muon`, `ns_method`, `zero_optimization.save_muon_momentum_buffer_in_memory`)
act in three places (ds-engine tags the parameters, ds-ops runs Newton–Schulz, ds-zero gathers the
matrices); the plan states them once, before anything is built.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ds_engine.config import DeepSpeedConfigError

if TYPE_CHECKING:
    from ds_engine.config import DeepSpeedConfig

logger = logging.getLogger(__name__)

__all__ = ["muon_lines"]

_GATHER = {
    1: "each rank all-gathers its Muon groups' gradient and momentum partitions",
    2: "each rank all-gathers its Muon groups' gradient and momentum partitions",
    3: (
        "per sub-group (zero_optimization.sub_group_size), runs of whole Muon matrices of at most "
        "zero_optimization.reduce_bucket_size gathered elements have their gradient and momentum shards all-gathered"
    ),
}


def muon_lines(config: DeepSpeedConfig, params: dict[str, Any], stage: int) -> tuple[str, ...]:
    """The Muon lines of the wrapper chain for optimizer params `params` at ZeRO `stage`.

    Raises:
        DeepSpeedConfigError: Muon at stage 3 with the optimizer offloaded to NVMe (named).
    """
    zero = config.zero.zero_config
    in_memory = bool(getattr(zero, "save_muon_momentum_buffer_in_memory", False))
    if stage == 3 and config.zero.offload_optimizer_device == "nvme":
        raise DeepSpeedConfigError(
            "zero_optimization.offload_optimizer.device: Muon at ZeRO stage 3 with NVMe optimizer offload is not "
            "supported in ds (the Muon update gathers each matrix's gradient and momentum, which the NVMe step "
            "keeps on disk); use offload_optimizer.device 'cpu' or 'none'"
        )
    if stage == 0:
        where = "MuonWithAuxAdam orthogonalizes each use_muon matrix in its step; momentum_buffer per matrix"
    else:
        where = (
            f"{_GATHER[stage]} after unscale, overflow check and clipping; every rank computes the whole-matrix "
            "update and keeps its own slice; the momentum stays partitioned in the optimizer state"
        )
    lines = [f"Muon: {where}"]
    if stage == 3:
        lines.append(
            f"  save_muon_momentum_buffer_in_memory={str(in_memory).lower()}: the Muon momentum is held in memory "
            "either way (ds never swaps it; NVMe optimizer offload is refused with Muon)"
        )
    if params.get("per_head_muon", False):
        lines.append(
            "  per_head_muon=true: attention q/k/v projections (model.config head geometry, checked against the "
            "shapes at initialize()) are orthogonalized head by head; other matrices whole"
        )
    else:
        lines.append("  per_head_muon=false: every Muon matrix is orthogonalized whole")
    method, steps = params.get("ns_method", "gram"), params.get("ns_steps", 5)
    lines.append(
        f"  ns_method={method}: {steps} quintic Newton-Schulz steps in fp32 (ds computes 'gram' and 'standard' alike)"
    )
    return tuple(lines)
