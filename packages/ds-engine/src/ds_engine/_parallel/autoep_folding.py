"""AutoEP folded with AutoTP at initialize(): which layouts run, and wiring the converted layers to the groups.

With `expert_parallel.enabled` and `tensor_parallel.autotp_size` T > 1 the dense layers are tensor-parallel
(AutoTP, over the mesh's consecutive `tp` groups) and the routed experts expert-parallel over groups of
`autoep_size` consecutive ranks that may span tensor-parallel lanes (DeepSpeed 0.19.8's folding layout,
`ds_parallel.autoep._folding`). Each lane runs its share of the routed assignments
(`ds_parallel.autoep._fold`), which keeps every gradient exact and the same on the lanes, so the engine's
usual families apply unchanged:

- dense parameters, cut or replicated: averaged over the dense data-parallel group (the mesh's `dp`);
- routed experts: summed over their expert-data-parallel group, divided by the dense data-parallel degree
  (the number of distinct batches), at ZeRO 0, 1 and 2 (ZeRO partitions them over that group);
- the clipping norm: cut shards summed over the tensor-parallel group, each expert counted once (summed over
  its expert-parallel group at stage 0; at ZeRO 1/2 the tensor-parallel peers hold other experts, or, with
  `autoep_size` below `autotp_size`, other ZeRO slices of the same experts, and are summed as shards are).

Refused, naming the key: what DeepSpeed refuses (`validate_folding_global`: autoep_size 1, pipeline,
sequence parallelism, ZeRO stage 3, DeepCompile, ZeRO offload, the data-before-expert order, expert tensor
parallelism). An `autoep_size` below `autotp_size` runs, as in DeepSpeed: the expert groups then split a
tensor-parallel group, and the peers holding the same experts are those experts' data-parallel replicas.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn
from torch.distributed import ProcessGroup

from ds_engine._optional import require
from ds_engine._plan.dist_info import DistInfo
from ds_engine.config._expert_parallel_section import ExpertParallelConfig

__all__ = ["FoldingFlags", "check_folding", "create_folding_groups", "fold_layers"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class FoldingFlags:
    """The config switches DeepSpeed's folding rules read (besides the sizes)."""

    deepcompile: bool = False
    offload_optimizer: bool = False
    offload_param: bool = False
    data_before_expert: bool = False
    tp_preset: str | None = None

    @classmethod
    def from_config(cls, ds_config: Any) -> FoldingFlags:
        """Read from a resolved `DeepSpeedConfig`."""
        parsed = ds_config.parsed
        compile_section = ds_config.raw.get("compile") or {}
        return cls(
            deepcompile=bool(isinstance(compile_section, dict) and compile_section.get("deepcompile")),
            offload_optimizer=ds_config.zero.offload_optimizer_device not in (None, "none"),
            offload_param=ds_config.zero.offload_param_device not in (None, "none"),
            data_before_expert=bool(parsed.use_data_before_expert_parallelism),
            tp_preset=getattr(parsed.tensor_parallel, "preset_model", None),
        )


def check_folding(
    section: ExpertParallelConfig, dist: DistInfo, *, tp_size: int, zero_stage: int, flags: FoldingFlags | None
) -> Any:
    """The folding spec of this run (`ds_parallel.autoep.ParallelFoldingSpec`), checked before any group exists.

    Raises:
        ValueError: a layout folding does not run (see the module docstring), naming the key.
    """
    ds_parallel = require("ds_parallel", extra="parallel", feature="AutoEP (expert_parallel.enabled)")
    flags = flags or FoldingFlags()
    autoep = ds_parallel.autoep
    spec = autoep.build_folding_spec(
        world_size=dist.world_size,
        pp_size=1,
        tp_size=tp_size,
        ep_size=section.autoep_size,
        etp_size=section.expert_tensor_parallel_size,
    )
    autoep.validate_folding_global(
        spec,
        zero_stage=zero_stage,
        sp_size=dist.sp_world_size,
        deepcompile_enabled=flags.deepcompile,
        use_data_before_expert_parallel=flags.data_before_expert,
        tp_preset=flags.tp_preset,
        ep_preset=section.preset_model,
        zero_offload_optimizer=flags.offload_optimizer,
        zero_offload_param=flags.offload_param,
    )
    return spec


def create_folding_groups(spec: Any, *, tp_group: ProcessGroup, dist: DistInfo) -> Any:
    """Create the folded expert groups (a collective) and return this rank's `FoldingGroupHandles`."""
    ds_parallel = require("ds_parallel", extra="parallel", feature="AutoEP (expert_parallel.enabled)")
    return ds_parallel.autoep.create_folding_groups(spec, tp_group=tp_group, dense_dp_group=dist.dp_group)


def fold_layers(model: nn.Module, handles: Any, *, validate_routing: bool = False) -> int:
    """Switch every converted `AutoEPMoELayer` of `model` to the folded dispatch; how many there were.

    `validate_routing` (`expert_parallel.validate_folding_routing`): each forward checks the lanes routed alike.
    """
    ds_parallel = require("ds_parallel", extra="parallel", feature="AutoEP (expert_parallel.enabled)")
    layers = [m for m in model.modules() if isinstance(m, ds_parallel.autoep.AutoEPMoELayer)]
    for layer in layers:
        layer.enable_folding(handles, validate_routing=validate_routing)
    return len(layers)
