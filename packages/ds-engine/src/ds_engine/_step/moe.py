"""Mixture-of-experts at initialize(): expert groups, the init broadcast, optimizer groups, expert gradients.

A model is MoE when a parameter carries DeepSpeed's expert mark (`allreduce = False`, with a `group_name`
such as `ep_size_2`; ds-parallel's `Experts` sets it). Then, decided once here:

- every module with `set_deepspeed_parallelism()` (each `MoE` layer) creates its expert-parallel and
  expert-data-parallel groups (ds-parallel, the `parallel` extra), in module order on every rank;
- the init broadcast sends dense parameters from data-parallel rank 0, expert parameters from rank 0 of
  their expert-data-parallel group (ranks at other expert-parallel positions hold other experts);
- an optimizer built from the config gets DeepSpeed's MoE param groups (`moe=True`, named by group);
- gradients: dense ones are averaged over the data-parallel group; expert ones are summed over their
  expert-data-parallel group and divided by the data-parallel world size (tokens of every rank reach an
  expert, as DeepSpeed's engine and ZeRO both scale them); ZeRO 1/2 partitions an expert group over its
  expert-data-parallel group;
- clipping uses the global norm: dense gradients once, every expert's once.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

import ds_comm
from ds_engine._linear.engine_hooks import replicated
from ds_engine._optional import require
from ds_engine._plan.dist_info import DistInfo
from ds_engine._plan.reduce_settings import ReduceSettings
from ds_engine._report.timers import NullTimers, WallClockTimers
from ds_engine._step.data_parallel import FlatGradBuffer, GradAllReducer, broadcast_module_states
from ds_engine._step.steppers import PlainOptimizerState
from ds_ops.precision import finish_step

logger = logging.getLogger(__name__)

__all__ = ["MoeLayer", "MoeWiring", "MoeFp32Stepper", "detect_moe", "expert_range_of", "publish_moe_mpu"]

_EXPERT_INDEX = re.compile(r"((?:^|\.)deepspeed_moe\.experts\.deepspeed_experts\.)(\d+)(\.)")
#: An AutoEP expert tensor's ZeRO name, `<module name>@experts{lo}:{hi}` (`moe_layout` makes it).
_EXPERT_RANGE = re.compile(r"^(?P<base>.+)@experts(?P<lo>\d+):(?P<hi>\d+)$")


def expert_range_of(zero_name: str) -> tuple[str, int, int] | None:
    """`(module name, first expert, end)` of an AutoEP expert tensor's ZeRO name; None for any other name."""
    m = _EXPERT_RANGE.match(zero_name)
    return (m["base"], int(m["lo"]), int(m["hi"])) if m else None


_EPS = 1e-6


def is_expert_param(p: torch.Tensor) -> bool:
    """DeepSpeed's mark of an expert parameter (`deepspeed.moe.utils.is_moe_param`)."""
    return hasattr(p, "allreduce") and not p.allreduce


@dataclasses.dataclass(frozen=True)
class MoeLayer:
    """One MoE layer's place in the model and in the expert-parallel layout (for checkpoints)."""

    prefix: str
    """The layer's module path (`"layers.1.moe"`)."""
    num_experts: int
    num_local_experts: int
    group_name: str
    ep_rank: int
    edp_rank: int
    fused_experts: tuple[str, ...] = ()
    """AutoEP layers: the module names of the `[num_local_experts, ...]` expert tensors (`experts.w1`, ...),
    one row per local expert; empty for DeepSpeed-MoE layers (one module per expert)."""

    def global_name(self, local_name: str) -> str:
        """`...deepspeed_experts.{i}...` -> `...deepspeed_experts.{ep_rank * local + i}...`."""
        return _EXPERT_INDEX.sub(
            lambda m: f"{m.group(1)}{self.ep_rank * self.num_local_experts + int(m.group(2))}{m.group(3)}",
            local_name,
            count=1,
        )


@dataclasses.dataclass
class MoeWiring:
    """Everything MoE the engine decided at initialize()."""

    ep_groups: dict[str, ProcessGroup]
    edp_groups: dict[str, ProcessGroup]
    edp_src: dict[str, int]
    layers: list[MoeLayer]
    expert_names: dict[str, str]
    """Module name of every expert parameter (and buffer) -> its name with the global expert index."""
    folding: Any = None
    """AutoEP folded with AutoTP: the layers' `FoldingGroupHandles` (the spec and this rank's groups); else None."""

    @property
    def num_experts(self) -> list[int]:
        return [layer.num_experts for layer in self.layers]

    def experts_across(self, tp_group: ProcessGroup, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The expert parameters among `params` that differ between the ranks of `tp_group` (at ZeRO 1/2).

        Beside tensor parallelism DeepSpeed's expert-parallel groups are consecutive ranks, so with ep_size
        a multiple of the tensor-parallel degree the tensor-parallel peers hold different experts: for the
        gradient norm those parameters count as cut across the group (summed over it), like AutoTP's shards.
        AutoEP folded with ep_size below the tensor-parallel degree: the peers holding the same experts are
        those experts' data-parallel replicas, over which ZeRO partitions them, so each peer holds another
        slice and they are summed the same way. With ep_size 1, or DeepSpeed-MoE expert groups inside
        tensor-parallel lanes, the peers hold the same experts (counted once). Parameters already cut
        (`tensor_model_parallel`) are left to the caller's list.

        Raises:
            ValueError: DeepSpeed-MoE (not folded) expert-parallel groups that split a tensor-parallel group
                (ep_size below the tensor-parallel degree and above 1): the peers would hold some experts
                twice.
        """
        peers = set(ds_comm.get_all_ranks_from_group(tp_group))
        across: set[str] = set()
        for name, group in self.ep_groups.items():
            shared = peers & set(ds_comm.get_all_ranks_from_group(group))
            if shared == peers:
                across.add(name)
            elif len(shared) > 1 and self.folding is not None:
                # folded, autoep_size below autotp_size: the peers holding the same experts are that expert's
                # data-parallel replicas, over which ZeRO partitions it, so each peer holds another slice
                across.add(name)
            elif len(shared) > 1:
                raise ValueError(
                    f"MoE {name} with a tensor-parallel group of {len(peers)} ranks: its expert-parallel groups "
                    "split the tensor-parallel group, so the peers hold some experts twice; use an ep_size "
                    "that is 1 or a multiple of tensor_parallel.autotp_size"
                )
        already_cut = {id(p) for p in params if getattr(p, "tensor_model_parallel", False)}
        return [
            p
            for p in params
            if is_expert_param(p) and getattr(p, "group_name", None) in across and id(p) not in already_cut
        ]

    def partition_groups(self, param_groups: list[dict[str, Any]]) -> list[ProcessGroup | None]:
        """For ZeRO 1/2: each MoE param group's expert-data-parallel group, None (data parallel) for the rest.

        Raises:
            ValueError: an expert parameter sits in a group without `moe=True` (or the other way round).
        """
        out: list[ProcessGroup | None] = []
        for i, group in enumerate(param_groups):
            experts = [is_expert_param(p) for p in group["params"]]
            if group.get("moe", False):
                if not all(experts):
                    raise ValueError(f"optimizer param group {i} is marked moe=True but holds non-expert parameters")
                name = group.get("name")
                if name not in self.edp_groups:
                    raise ValueError(
                        f"optimizer param group {i} is an MoE group named {name!r}, not an expert group of this "
                        f"model ({', '.join(sorted(self.edp_groups))})"
                    )
                out.append(self.edp_groups[name])
            else:
                if any(experts):
                    raise ValueError(
                        f"optimizer param group {i} mixes expert parameters with dense ones; ZeRO reduces "
                        "them over different groups. Build the optimizer over "
                        "deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer(groups), "
                        "or let the config's optimizer section build it"
                    )
                out.append(None)
        return out


def publish_moe_mpu(module: nn.Module, mpu: Any) -> None:
    """Hand the client's mpu (or the mesh's) to ds-parallel's groups (DeepSpeed's `groups.mpu = mpu`) for an
    MoE model, so its layers see the model's tensor-parallel group and lay their expert groups out around it.
    Nothing for a dense model or without an mpu."""
    if mpu is None or not any(is_expert_param(p) for p in module.parameters()):
        return
    ds_parallel = require("ds_parallel", extra="parallel", feature="mixture-of-experts (MoE layers)")
    ds_parallel.groups.mpu = mpu


def detect_moe(module: nn.Module, dist: DistInfo, *, data_before_expert: bool = False) -> MoeWiring | None:
    """Set up the expert groups of an MoE model (a collective); None for a dense model.

    `data_before_expert` (the config's `use_data_before_expert_parallelism`) asks every layer for DeepSpeed's
    D + E layout: expert-data-parallel groups of consecutive ranks, expert-parallel groups strided over them.

    Raises:
        ImportError: ds-parallel is missing (names `pip install 'ds-engine[parallel]'`).
    """
    names = sorted({p.group_name for p in module.parameters() if is_expert_param(p)})
    if not names:
        return None
    ds_parallel = require("ds_parallel", extra="parallel", feature="mixture-of-experts (MoE layers)")
    for sub in module.modules():  # the model itself may be the MoE layer
        if hasattr(sub, "set_deepspeed_parallelism"):
            sub.set_deepspeed_parallelism(use_data_before_expert_parallel_=data_before_expert)
    groups = ds_parallel.groups
    for name in names:  # expert params whose layer has no set_deepspeed_parallelism: build from the name
        if name not in groups._get_expert_parallel_group_dict():
            groups._create_expert_and_data_parallel(
                int(name.rsplit("_", 1)[1]), use_data_before_expert_parallel_=data_before_expert
            )
    dp = groups._get_data_parallel_world_size()  # model replicas: sequence-parallel peers are one replica
    if dp != dist.replica_world_size:
        raise ValueError(
            f"MoE: ds-parallel's data-parallel world ({dp}) differs from the engine's ({dist.replica_world_size} "
            "replicas); an mpu that splits the world another way is not supported with MoE layers"
        )
    layers, expert_names = moe_layout(module)
    wiring = MoeWiring(
        ep_groups={n: groups._get_expert_parallel_group(n) for n in names},
        edp_groups={n: groups._get_expert_data_parallel_group(n) for n in names},
        edp_src={n: groups._get_expert_broadcast_src_rank(n) for n in names},
        layers=layers,
        expert_names=expert_names,
        folding=next((h for h in (getattr(m, "folding_group_handles", None) for m in module.modules()) if h), None),
    )
    logger.info("MoE: %d layer(s), experts %s, expert groups %s", len(layers), wiring.num_experts, ", ".join(names))
    return wiring


def moe_layout(module: nn.Module) -> tuple[list[MoeLayer], dict[str, str]]:
    """The MoE layers of `module` (module order) and every expert entry's name -> its global-index name.

    Needs the expert groups to exist (ds-parallel's, set up by the layers' `set_deepspeed_parallelism`).
    """
    ds_parallel = require("ds_parallel", extra="parallel", feature="mixture-of-experts (MoE layers)")
    groups = ds_parallel.groups
    layers: list[MoeLayer] = []
    expert_names: dict[str, str] = {}
    for prefix, sub in module.named_modules():
        if isinstance(sub, ds_parallel.moe.MoE):
            layer = MoeLayer(
                prefix=prefix,
                num_experts=sub.num_experts,
                num_local_experts=sub.num_local_experts,
                group_name=sub.expert_group_name,
                ep_rank=groups._get_expert_parallel_rank(sub.expert_group_name),
                edp_rank=groups._get_expert_data_parallel_rank(sub.expert_group_name),
            )
            layers.append(layer)
            head = f"{prefix}." if prefix else ""
            for name, _ in sub.state_dict(keep_vars=True).items():
                full = head + name
                if _EXPERT_INDEX.search(full):
                    expert_names[full] = layer.global_name(full)
        elif isinstance(sub, ds_parallel.autoep.AutoEPMoELayer):
            layer = autoep_layer(prefix, sub, groups)
            layers.append(layer)
            lo, hi = sub.local_experts.start, sub.local_experts.stop
            for name in layer.fused_experts:  # unique per expert range, so ZeRO never mixes two ranks' experts
                expert_names[name] = f"{name}@experts{lo}:{hi}"
    return layers, expert_names


def autoep_layer(prefix: str, sub: Any, groups: Any) -> MoeLayer:
    """An AutoEP layer's place: its stacked expert tensors hold experts `ep_rank * local ...` in rows."""
    head = f"{prefix}." if prefix else ""
    return MoeLayer(
        prefix=prefix,
        num_experts=sub.num_experts,
        num_local_experts=sub.num_local_experts,
        group_name=sub.ep_group_name,
        ep_rank=groups._get_expert_parallel_rank(sub.ep_group_name),
        edp_rank=groups._get_expert_data_parallel_rank(sub.ep_group_name),
        fused_experts=tuple(f"{head}experts.{n}" for n, _ in sub.experts.named_parameters()),
    )


def broadcast_moe_model(module: nn.Module, wiring: MoeWiring, dist: DistInfo) -> None:
    """The init broadcast: dense tensors from data-parallel rank 0, experts within their expert-data-parallel group.

    Collective over the data-parallel group and every expert-data-parallel group.
    """
    by_name: dict[str, list[torch.Tensor]] = {}
    dense: list[torch.Tensor] = []
    for p in replicated(module.parameters()):  # not OptimizedLinear base-weight slices
        if hasattr(p, "ds_tensor"):  # partitioned under zero.Init: its shards came from rank 0 already
            continue
        if is_expert_param(p):
            by_name.setdefault(p.group_name, []).append(p)
        else:
            dense.append(p)
    expert_buffer_ids = set()
    for layer in wiring.layers:
        for name, b in module.get_submodule(layer.prefix).named_buffers():
            if ".deepspeed_experts." in f".{name}":
                by_name.setdefault(layer.group_name, []).append(b)
                expert_buffer_ids.add(id(b))
    dense += [b for b in module.buffers() if id(b) not in expert_buffer_ids]
    if dist.dp_world_size > 1:
        broadcast_module_states(dense, src=dist.dp_src_rank, group=dist.dp_group)
    for name in sorted(by_name):
        group = wiring.edp_groups[name]
        if ds_comm.get_world_size(group) > 1:
            broadcast_module_states(by_name[name], src=wiring.edp_src[name], group=group)


def moe_param_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """DeepSpeed's MoE param groups for an optimizer the config builds (unnamed groups get a name); groups
    that already include MoE groups (`moe` keys) are used as they are, as DeepSpeed does."""
    if any("moe" in g for g in groups):
        return groups
    ds_parallel = require("ds_parallel", extra="parallel", feature="mixture-of-experts (MoE layers)")
    split = ds_parallel.moe.split_params_into_different_moe_groups_for_optimizer
    named = [
        {**g, "name": g.get("name", "dense-params" if i == 0 else f"dense-params-{i}")} for i, g in enumerate(groups)
    ]
    result: list[dict[str, Any]] = split(named)
    return result


class MoeFp32Stepper(PlainOptimizerState):
    """fp32 at ZeRO stage 0 for an MoE model: dense and expert gradients in separate flat buffers.

    The dense buffer is all-reduced (averaged) over the data-parallel group; each expert group's buffer is
    all-reduced over its expert-data-parallel group and divided by the data-parallel world size. The
    clipping norm adds the dense gradients' squares (the same on every rank; with tensor parallelism the
    squares of the cut parameters are summed over `model_parallel_group`) and each expert group's, summed
    over its expert-parallel group (each rank holds other experts).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        wiring: MoeWiring,
        dist: DistInfo,
        settings: ReduceSettings | None,
        clip: float,
        timers: WallClockTimers | NullTimers,
        model_parallel_group: ProcessGroup | None = None,
        model_parallel_params: Sequence[torch.Tensor] = (),
    ) -> None:
        self.optimizer = optimizer
        self.clip = clip
        self.model_parallel_group = model_parallel_group
        self._cut_dense: list[torch.Tensor] = []  # views of the dense buffer: parameters AutoTP cut
        self.timers = timers
        self._norm: float | None = None
        self._reduced = False
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        dense = [p for p in params if not is_expert_param(p)]
        experts: dict[str, list[torch.Tensor]] = {}
        for p in params:
            if is_expert_param(p):
                experts.setdefault(p.group_name, []).append(p)
        self.buffers: list[FlatGradBuffer] = []
        self.reducers: list[GradAllReducer] = []
        self.norm_groups: list[ProcessGroup | None] = []  # where each buffer's squares are summed (None: here)
        reduce = settings or ReduceSettings()
        if dense:
            buffer = FlatGradBuffer(dense, torch.float32, bind=True, lazy_bind=True)
            if model_parallel_group is not None:
                cut = {id(p) for p in model_parallel_params}
                self._cut_dense = buffer.views_of([p for p in dense if id(p) in cut])
            self.buffers.append(buffer)
            self.norm_groups.append(None)
            if dist.dp_world_size > 1:
                self.reducers.append(GradAllReducer(buffer, reduce, group=dist.dp_group, world_size=dist.dp_world_size))
        for name in sorted(experts):
            buffer = FlatGradBuffer(experts[name], torch.float32, bind=True, lazy_bind=True)
            self.buffers.append(buffer)
            self.norm_groups.append(wiring.ep_groups[name])
            # The reducer also divides by the data-parallel world (an expert's gradient sums the tokens every
            # replica routed to it), so it is needed with several replicas even when the expert-data-parallel
            # group is one rank; and with tensor parallelism that group spans tensor-parallel peers (each held
            # a slice of the tokens) even when there is one replica.
            if dist.dp_world_size > 1 or ds_comm.get_world_size(wiring.edp_groups[name]) > 1:
                self.reducers.append(
                    GradAllReducer(buffer, reduce, group=wiring.edp_groups[name], world_size=dist.dp_world_size)
                )

    def backward(self, loss: torch.Tensor, retain_graph: bool) -> None:
        loss.backward(retain_graph=retain_graph)

    def _global_norm(self) -> float:
        total = 0.0
        for buffer, group in zip(self.buffers, self.norm_groups, strict=True):
            sq = buffer.flat.float().square().sum().reshape(1)
            if group is not None and ds_comm.get_world_size(group) > 1:
                ds_comm.all_reduce(sq, group=group)
            total += float(sq)
        if self.model_parallel_group is not None and self._cut_dense:  # the other shards of the cut parameters
            cut_sq = sum((v.float().square().sum() for v in self._cut_dense), torch.zeros(())).reshape(1)
            mine = float(cut_sq)
            ds_comm.all_reduce(cut_sq, group=self.model_parallel_group)
            total += float(cut_sq) - mine
        return total**0.5

    def reduce_gradients(self) -> None:
        """All-reduce the accumulated dense and expert gradients now (`engine.allreduce_gradients()`, which the
        engine's backward calls at the window's boundary, as DeepSpeed's does); the step then skips it."""
        if self._reduced:
            return
        for buffer in self.buffers:
            buffer.rebind()
        self.timers.start("allreduce")
        for reducer in self.reducers:
            reducer.all_reduce()
        self.timers.stop("allreduce")
        self._reduced = True

    def step(self, skip: torch.Tensor | None = None) -> bool:
        self.reduce_gradients()
        self._reduced = False
        if self.clip > 0:
            self._norm = self._global_norm()
            coef = min(self.clip / (self._norm + _EPS), 1.0)
            if coef < 1.0:
                for buffer in self.buffers:
                    buffer.flat.mul_(coef)
        outcome = finish_step([b.flat for b in self.buffers], scaler=None, clip=0.0, check_overflow=False, skip=skip)
        if outcome.applied:
            self.optimizer.step()
        for buffer in self.buffers:
            buffer.release()
        return outcome.applied

    def zero_grad(self) -> None:
        for buffer in self.buffers:
            buffer.release()
        self._reduced = False
