"""The process layout initialize() trains on: one set of degrees, at most one mesh, one `DistInfo`.

Where the layout comes from, in order:

* an mpu (the client's `mpu=`, or a PipelineModule's grid): it is the layout, read into `DistInfo`
  as it is; the config's degrees are then checked against it (`check_sequence_parallel`, the
  tensor-parallel check) rather than used to build anything;
* otherwise the config: `tensor_parallel.autotp_size` (or `tp_model_init`'s size) and
  `sequence_parallel_size`. When either is above 1, ds-parallel's mesh is built once with both dims
  (`ParallelDims`; tp innermost, so a tensor-parallel group is consecutive ranks that hold the same
  sequence shard, and sp inside dp), data parallelism taking the ranks left. An MoE model's expert degree
  (its layers' `ep_size`; DeepSpeed has no config key for it) joins the same mesh as its `ep` dim, inside
  data parallelism, where it folds: one degree, no tensor parallelism (beside it DeepSpeed's expert groups
  are consecutive ranks across the tensor-parallel peers, not a mesh dim), dividing the data-parallel degree
  (otherwise the layer's own groups refuse it by name);
* neither: plain data parallelism over the world, without ds-parallel (an optional extra).

The batch triple is resolved for the data-parallel replicas, which depend on the degrees, while the
degrees are read from the config. `requested_degrees` reads them from the raw config (no validation)
so the config is validated once, for the replica count `expected_replica_world_size` predicts;
initialize() re-resolves only if the validated degrees turn out different (a value pydantic coerced).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import ds_comm
from ds_engine._optional import require
from ds_engine._parallel.tp_model_init import recorded_tp_size
from ds_engine._plan.dist_info import DistInfo, discover_dist

if TYPE_CHECKING:
    from ds_engine.config import DeepSpeedConfig

logger = logging.getLogger(__name__)

__all__ = [
    "ParallelLayout",
    "check_degrees_fit",
    "expected_replica_world_size",
    "model_expert_degree",
    "requested_degrees",
    "resolve_parallel_layout",
]


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """How this job's ranks are split, as the engine is assembled on it."""

    dims: Any
    """ds-parallel's `ParallelDims` of the mesh initialize() built; None when an mpu (the client's or a
    PipelineModule's grid) is the layout, or for plain data parallelism (ds-parallel not needed)."""
    mpu: Any
    """The mpu the engine uses: the client's, the grid, the built mesh's `MeshMPU`, or None."""
    dist: DistInfo
    """The layout as the engine reads it (data-parallel group, model-parallel and sequence degrees)."""


def _positive_int(value: Any) -> int:
    """`value` when it is a degree as written (a positive int), else 1: validation names anything else."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else 1


def requested_degrees(source: str | os.PathLike[str] | Mapping[str, Any] | DeepSpeedConfig) -> tuple[int, int]:
    """The (tensor, sequence) parallel degrees the config asks for, read before it is validated.

    The tensor degree is `tensor_parallel.autotp_size`, or `tp_model_init`'s recorded size when the key
    is unset (the record is not consumed). A value that is not a positive int counts as 1 here: the
    validation that follows names it.

    Raises:
        DeepSpeedConfigError / TypeError: the source cannot be read (the same error validation gives).
    """
    from ds_engine.config import DeepSpeedConfig  # pydantic: loaded when a config is read, not at import
    from ds_engine.config._load import load_raw

    if isinstance(source, DeepSpeedConfig):
        tp = source.parsed.tensor_parallel.autotp_size
        return max(tp or recorded_tp_size() or 1, 1), source.parsed.sequence_parallel_size
    raw = load_raw(source)
    section = raw.get("tensor_parallel")
    value = section.get("autotp_size") if isinstance(section, dict) else None
    unset = value is None or (type(value) is int and value == 0)  # 0 is the key's default: tp_model_init fills it
    tp = (recorded_tp_size() or 1) if unset else _positive_int(value)
    return tp, _positive_int(raw.get("sequence_parallel_size"))


def _world_size() -> int:
    return ds_comm.get_world_size() if ds_comm.is_initialized() else 1


def expected_replica_world_size(tp: int, sp: int, *, mpu: Any) -> int:
    """The data-parallel replica count the batch triple will be resolved for.

    The mpu's when one is given; else the world over tp x sp when that divides it, else the world
    (the layout then refuses the degrees, after the config's own problems are reported).
    """
    if mpu is not None:
        return discover_dist(mpu).replica_world_size
    world, per_replica = _world_size(), max(tp, 1) * max(sp, 1)
    return world // per_replica if world % per_replica == 0 else world


def _keys(tp: int, sp: int) -> str:
    named = [f"tensor_parallel.autotp_size={tp}"] if tp > 1 else []
    return " and ".join(named + ([f"sequence_parallel_size={sp}"] if sp > 1 else []))


def check_degrees_fit(world_size: int, tp: int, sp: int) -> None:
    """The world must split into data-parallel replicas of tp x sp ranks.

    Raises:
        ValueError: it does not, naming the config keys, the world size and the sizes that would fit.
    """
    tp, sp = max(tp, 1), max(sp, 1)  # autotp_size 0 is unset: no tensor parallelism
    per_replica = tp * sp
    if world_size % per_replica == 0:
        return
    fits = [d for d in range(1, world_size + 1) if world_size % d == 0]
    raise ValueError(
        f"{_keys(tp, sp)}: a model replica spans {tp} x {sp} = {per_replica} ranks (tensor x sequence parallel), "
        f"which does not divide the world size {world_size}; choose degrees whose product is one of {fits}"
    )


def model_expert_degree(module: Any) -> int:
    """The expert-parallel degree of `module`'s MoE layers when they share one (1: dense, or several degrees).

    Read from DeepSpeed's expert mark on parameters (`allreduce = False`, `group_name = "ep_size_N"`).
    """
    names = {getattr(p, "group_name", "") for p in module.parameters() if getattr(p, "allreduce", True) is False}
    if len(names) != 1:
        return 1
    (name,) = names
    prefix, _, degree = name.rpartition("_")
    return int(degree) if prefix == "ep_size" and degree.isdigit() else 1


def resolve_parallel_layout(*, tp: int, sp: int, mpu: Any, ep: int = 1) -> ParallelLayout:
    """The layout for degrees `tp`, `sp` (validated) and an optional mpu (the client's, or a pipeline's grid).

    With no mpu and `tp` or `sp` above 1, builds ds-parallel's process-wide mesh (a collective on every
    rank) with both dims, and with the model's expert degree `ep` as its `ep` dim where that folds (no
    tensor parallelism, `ep` divides the data-parallel degree); otherwise builds nothing.

    Raises:
        ValueError: the degrees do not fit the world (`check_degrees_fit`).
        RuntimeError: tp/sp asked for without a process group (`dist_init_required=False` and none exists).
        ImportError: ds-parallel is missing (names `pip install 'ds-engine[parallel]'`).
    """
    tp, sp = max(tp, 1), max(sp, 1)  # autotp_size 0 is unset: no tensor parallelism
    if mpu is not None and hasattr(mpu, "initialize_sequence_parallel"):
        mpu = _mesh_of_module_mpu(mpu)
    if mpu is not None or (tp == 1 and sp == 1):
        return ParallelLayout(dims=None, mpu=mpu, dist=discover_dist(mpu))
    if not ds_comm.is_initialized():
        raise RuntimeError(
            f"{_keys(tp, sp)}: building the process mesh needs torch.distributed initialised; do not pass "
            "dist_init_required=False without a process group (launch the job with the ds launcher or torchrun)"
        )
    world = _world_size()
    check_degrees_fit(world, tp, sp)
    ds_parallel = require("ds_parallel", extra="parallel", feature=_keys(tp, sp))
    dp = world // (tp * sp)
    folds = tp == 1 and ep > 1 and dp % ep == 0
    dims = ds_parallel.ParallelDims(world_size=world, tp=tp, sp=sp, ep=ep if folds else 1)
    built = ds_parallel.MeshMPU(ds_parallel.groups.initialize_mesh(dims))
    logger.debug("initialize(): built the process mesh %r", dims)
    return ParallelLayout(dims=dims, mpu=built, dist=discover_dist(built))


def _mesh_of_module_mpu(module: Any) -> Any:
    """The engine's mpu for DeepSpeed's module-level ALST mpu (`parallel_state_sp` passed as `mpu=`).

    That module answers `get_model_parallel_*` with its sequence-parallel group, as DeepSpeed's does, and
    DeepSpeed's engine therefore counts no model parallelism for an mpu that has `initialize_sequence_parallel`.
    ds does the same by reading the mesh the module installed through ds-parallel's `MeshMPU`, whose model
    parallel dim is tensor parallelism.
    """
    ds_parallel = require("ds_parallel", extra="parallel", feature="mpu=parallel_state_sp (the ALST mpu)")
    return ds_parallel.MeshMPU(ds_parallel.groups.get_mesh())
