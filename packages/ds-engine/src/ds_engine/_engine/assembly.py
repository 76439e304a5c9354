"""Build the wrapper chain once: cast and place the model, sync it, base optimizer, wrapper, scheduler, reporting.

The order matters and is the whole recipe:
  1. cast parameters (not buffers) to the training dtype and move the module to its device; with
     `torch_autocast`, tag the lower-precision-safe parameters;
  2. broadcast parameters and buffers from data-parallel rank 0 (at stage 3 only those `zero.Init` has not
     partitioned), so every rank starts equal;
  3. the base optimizer over the cast parameters (client instance, client callable, or from the config);
  4. the wrapper: nothing (fp32), `MixedPrecisionOptimizer` (fp16/bf16), or ds-zero's optimizer (stage >= 1);
     stage 3 without an optimizer gets ds-zero's `DeepSpeedZeRoOffload` (evaluation, parameters still scheduled);
  5. the lr scheduler over the base optimizer (its param groups are the ones the wrapper steps);
  6. data loader, timers, monitors.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim import Optimizer

import ds_comm
from ds_comm import get_accelerator
from ds_engine._checkpoint.deepspeed_layout import check_deepspeed_layout_moe
from ds_engine._data.loader import CurriculumDataLoader
from ds_engine._engine.dataloader import DeepSpeedDataLoader, make_curriculum_loader, make_dataloader
from ds_engine._linear.engine_hooks import OptimizedLinearLayout, apply_offload, replicated
from ds_engine._optim.muon import tag_muon_params
from ds_engine._optim.optimizers import (
    call_optimizer_factory,
    is_zero_tested_optimizer,
    normalize_param_groups,
    swap_for_cpu_optimizer,
)
from ds_engine._optim.schedulers import build_config_scheduler
from ds_engine._parallel.tensor_parallel import TensorParallelState
from ds_engine._plan.dist_info import DistInfo
from ds_engine._plan.plan import AssemblyPlan, scales_autocast_loss
from ds_engine._report.monitors import MonitorMaster, build_monitor
from ds_engine._report.reporting import StepReporter
from ds_engine._report.timers import NullTimers, ThroughputTimer, WallClockTimers
from ds_engine._step.autocast import AutocastPolicy, mark_lower_precision_params, resolve_module_classes
from ds_engine._step.data_parallel import FlatGradBuffer, GradAllReducer, broadcast_module_states
from ds_engine._step.mixed_precision import cast_module_mixed_precision, keep_in_fp32_pattern
from ds_engine._step.moe import MoeFp32Stepper, MoeWiring, broadcast_moe_model, detect_moe, moe_param_groups
from ds_engine._step.moe_zero3 import check_zero3_moe, mark_zero3_placement
from ds_engine._step.precision import MixedPrecisionOptimizer
from ds_engine._step.steppers import Fp32Stepper, Stepper, ZeroStepper
from ds_engine._step.zero_wiring import (
    broadcast_unpartitioned,
    build_parameter_offload,
    build_zero_optimizer,
    loss_scaler_for,
)
from ds_engine.config import DeepSpeedConfigError

if TYPE_CHECKING:
    from ds_engine.config import DeepSpeedConfig

logger = logging.getLogger(__name__)

__all__ = ["AssemblyInputs", "EngineParts", "assemble"]


@dataclasses.dataclass
class EngineParts:
    """Everything `DeepSpeedEngine.__init__` wires together."""

    module: nn.Module
    config: DeepSpeedConfig
    plan: AssemblyPlan
    dist: DistInfo
    device: torch.device
    stepper: Stepper | None
    optimizer: Any
    basic_optimizer: Optimizer | None
    lr_scheduler: Any
    training_dataloader: DeepSpeedDataLoader | CurriculumDataLoader | None
    timers: WallClockTimers | NullTimers
    reporter: StepReporter
    monitor: MonitorMaster | None
    collate_fn: Callable[..., Any] | None
    parameter_offload: Any = None
    """Stage 3 without an optimizer: the `ds_zero.DeepSpeedZeRoOffload` that schedules the parameters."""
    tensor_parallel: TensorParallelState | None = None
    """With `tensor_parallel.autotp_size` > 1: the tensor-parallel group and whole-weight I/O."""
    moe: MoeWiring | None = None
    """The MoE layout (expert groups, layers) when the model has expert parameters."""
    autocast: AutocastPolicy | None = None
    """How the forward runs under `torch.autocast` (None: as a disabled `torch_autocast` section)."""
    optimized_linear: OptimizedLinearLayout = dataclasses.field(default_factory=OptimizedLinearLayout)
    """The model's `deepspeed.linear` LoRA layers (sharded base weights, offload)."""


def _place_and_cast(module: nn.Module, plan: AssemblyPlan, device: torch.device) -> None:
    acc = get_accelerator()
    if plan.precision == "fp16" and not acc.is_fp16_supported():
        raise DeepSpeedConfigError(f"fp16.enabled: fp16 is not supported on this {acc.name} device; use bf16 or fp32")
    if plan.precision == "bf16" and not acc.is_bf16_supported():
        raise DeepSpeedConfigError(f"bf16.enabled: bf16 is not supported on this {acc.name} device; use fp16 or fp32")
    module.to(device)
    keep = keep_in_fp32_pattern(module, plan.keep_in_fp32_modules, plan.dtype)
    cast_module_mixed_precision(module, plan.dtype, plan.buffer_dtype, keep_fp32=keep)


def _base_optimizer(
    plan: AssemblyPlan,
    config: DeepSpeedConfig,
    module: nn.Module,
    client: Any,
    model_parameters: Any,
    moe: MoeWiring | None = None,
    tp_size: int = 1,
) -> Optimizer | None:
    if isinstance(client, Optimizer):
        if config.parsed.optimizer is not None:
            logger.warning("the optimizer passed to initialize() overrides the config's optimizer section")
        optimizer = client
    elif client is not None:
        optimizer = call_optimizer_factory(client, normalize_param_groups(model_parameters, module))
    elif plan.optimizer is not None:
        if plan.optimizer.name == "muon":
            tag_muon_params(
                module,
                per_head=bool(plan.optimizer.kwargs.get("per_head_muon", False)),
                tp_size=tp_size,
            )
        groups = normalize_param_groups(model_parameters, module)
        optimizer = plan.optimizer.build(moe_param_groups(groups) if moe is not None else groups)
    else:
        return None
    if plan.offload_optimizer and client is not None:
        # Client optimizers only, as DeepSpeed's force check: the config's were planned for offload
        # already, and its `torch_adam: true` stays torch's Adam ([Note: Adam routing]).
        optimizer = swap_for_cpu_optimizer(optimizer, force=config.parsed.zero_force_ds_cpu_optimizer)
    if (
        plan.zero_stage >= 1
        and not config.parsed.zero_allow_untested_optimizer
        and not is_zero_tested_optimizer(optimizer)
    ):
        raise DeepSpeedConfigError(
            f"zero_allow_untested_optimizer: {type(optimizer).__name__} is not tested with ZeRO stage "
            f"{plan.zero_stage} (tested: Adam, AdamW, Adagrad, Lamb, Lion, Muon); set it to true to use it anyway"
        )
    return optimizer


def _trainable(optimizer: Optimizer) -> list[torch.Tensor]:
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if not params:
        raise ValueError("the optimizer has no trainable parameters (all requires_grad=False?)")
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(
            f"trainable parameters are on several devices {sorted(map(str, devices))}; the engine "
            "keeps one model replica per device"
        )
    return params


def _check_optimizer_needed(plan: AssemblyPlan) -> None:
    if plan.optimizer_source == "none" and plan.zero_stage in (1, 2):
        # DeepSpeed refuses this too ("zero stage N requires an optimizer"); stage 3 has an evaluation path.
        raise DeepSpeedConfigError(
            f"zero_optimization.stage={plan.zero_stage} needs an optimizer (stages 1 and 2 partition optimizer "
            'state): add an "optimizer" section or pass optimizer= to initialize(); to evaluate without an '
            "optimizer use stage 0 (replicated model) or stage 3 (partitioned parameters)"
        )


def _stepper(
    plan: AssemblyPlan,
    config: DeepSpeedConfig,
    base: Optimizer | None,
    module: nn.Module,
    dist: DistInfo,
    timers: WallClockTimers | NullTimers,
    moe: MoeWiring | None = None,
    tp: TensorParallelState | None = None,
) -> tuple[Stepper | None, Any]:
    """(the stepper the engine drives, the optimizer initialize() returns); (None, None) without an optimizer.

    With tensor parallelism every stepper gets the group and the cut parameters, so its norm and overflow
    flag span the shards (`_tensor_parallel`'s note: the norm and the overflow flag).
    """
    if base is None:
        return None, None
    mp: dict[str, Any] = {}
    if tp is not None:
        params = [p for g in base.param_groups for p in g["params"]]
        mp = {"model_parallel_group": tp.group, "model_parallel_params": tp.cut_params(params)}
    if plan.zero_stage >= 1:
        if tp is not None and moe is not None:  # tensor-parallel peers holding other experts: summed as shards are
            mp["model_parallel_params"] += moe.experts_across(tp.group, params)
        zero = build_zero_optimizer(plan, config, base, module, dist, moe=moe, model_parallel=mp)
        return ZeroStepper(zero), zero
    if moe is not None and plan.precision == "fp32":  # expert norms are summed over their expert-parallel groups
        _trainable(base)
        stepper = MoeFp32Stepper(base, wiring=moe, dist=dist, settings=plan.reduce, clip=plan.clip, timers=timers, **mp)
        return stepper, base
    if plan.precision == "fp32":
        buffer = FlatGradBuffer(_trainable(base), torch.float32, bind=True, lazy_bind=True)
        reducer = (
            None
            if plan.reduce is None
            else GradAllReducer(buffer, plan.reduce, group=dist.dp_group, world_size=dist.dp_world_size)
        )
        scaler = loss_scaler_for(plan) if scales_autocast_loss(plan) else None
        return Fp32Stepper(
            base, buffer=buffer, reducer=reducer, clip=plan.clip, timers=timers, scaler=scaler, **mp
        ), base
    _trainable(base)
    wrapped = MixedPrecisionOptimizer(
        base,
        dtype=plan.dtype,
        loss_scaler=loss_scaler_for(plan),
        grad_accum_dtype=plan.grad_accum_dtype,
        immediate_grad_update=plan.immediate_grad_update,
        clip_grad=plan.clip,
        check_overflow=plan.check_overflow,
        reduce=plan.reduce,
        group=dist.dp_group,
        world_size=dist.dp_world_size,
        timers=timers,
        moe=moe,
        **mp,
    )
    return wrapped, wrapped


def _scheduler(config: DeepSpeedConfig, client: Any, base: Optimizer | None, client_optimizer: Any) -> Any:
    if client is not None:
        if config.parsed.scheduler is not None:
            logger.warning("the lr_scheduler passed to initialize() overrides the config's scheduler section")
        if hasattr(client, "step"):
            if not isinstance(client_optimizer, Optimizer):
                raise ds_comm.UsageError(
                    "a client lr_scheduler instance needs a client optimizer instance (it was built over "
                    "an optimizer the engine does not use); pass optimizer=, or pass the scheduler as a "
                    "callable(optimizer)"
                )
            return client
        if base is None:
            raise ds_comm.UsageError("lr_scheduler callable given but there is no optimizer to schedule")
        return client(base)
    sched = config.parsed.scheduler
    if sched is None:
        return None
    if base is None:
        raise DeepSpeedConfigError("scheduler: a scheduler section needs an optimizer (config section or optimizer=)")
    return build_config_scheduler(sched.type, dict(sched.params), base)


def _check_partitioned_parameters(module: nn.Module, plan: AssemblyPlan) -> None:
    """Refuse, before anything is moved, a model built under `zero.Init` when the config is not stage 3: its
    parameters hold only this rank's shard, which no other stage can train (DeepSpeed goes on and trains
    placeholders)."""
    if plan.zero_stage == 3:
        return
    partitioned = [name for name, p in module.named_parameters() if hasattr(p, "ds_tensor")]
    if partitioned:
        raise DeepSpeedConfigError(
            f"zero_optimization.stage: the model's parameters are partitioned ({len(partitioned)} of them, first "
            f"{partitioned[0]!r}: built under deepspeed.zero.Init), which only ZeRO stage 3 trains, but the "
            f"config says stage {plan.zero_stage}; set zero_optimization.stage to 3, or build the model outside "
            "zero.Init"
        )


def _broadcast(module: nn.Module, plan: AssemblyPlan, dist: DistInfo, moe: MoeWiring | None) -> None:
    if moe is not None:
        broadcast_moe_model(module, moe, dist)
    elif plan.zero_stage == 3:
        broadcast_unpartitioned(module, dist)
    elif dist.dp_world_size > 1:
        tensors = replicated([*module.parameters(), *module.buffers()])  # not OptimizedLinear base-weight slices
        broadcast_module_states(tensors, src=dist.dp_src_rank, group=dist.dp_group)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AssemblyInputs:
    """What `initialize()` hands the assembly, as one value: the client's objects and what was decided about them.

    The pipeline builder passes it on with its own changes (`dataclasses.replace`), so the arguments are
    written once, not at every call.
    """

    module: nn.Module
    config: DeepSpeedConfig
    plan: AssemblyPlan
    dist: DistInfo
    device: torch.device
    client_optimizer: Any = None
    """A torch optimizer, a callable over param groups, or None (the config's `optimizer`)."""
    model_parameters: Any = None
    client_scheduler: Any = None
    training_data: Any = None
    collate_fn: Callable[..., Any] | None = None
    tensor_parallel: TensorParallelState | None = None
    shuffle_training_data: bool = True
    """DeepSpeed's sampling of `training_data`: the engine's loader shuffles it (DistributedSampler, seed 0,
    the same order every epoch); the PipelineEngine's reads it in order."""


def assemble(inputs: AssemblyInputs) -> EngineParts:
    """Carry out `inputs.plan` (see the module docstring for the order)."""
    module, config, plan, dist, device = inputs.module, inputs.config, inputs.plan, inputs.dist, inputs.device
    client_optimizer, client_scheduler = inputs.client_optimizer, inputs.client_scheduler
    model_parameters, training_data, collate_fn = inputs.model_parameters, inputs.training_data, inputs.collate_fn
    tensor_parallel, shuffle_training_data = inputs.tensor_parallel, inputs.shuffle_training_data
    m = config.parsed
    _check_optimizer_needed(plan)
    _check_partitioned_parameters(module, plan)
    safe_classes = resolve_module_classes(m.torch_autocast.lower_precision_safe_modules)
    _place_and_cast(module, plan, device)
    if plan.autocast_dtype is not None:
        mark_lower_precision_params(module, plan.autocast_dtype, safe_classes)
    moe = detect_moe(module, dist, data_before_expert=m.use_data_before_expert_parallelism)
    check_deepspeed_layout_moe(config, has_moe=moe is not None)
    if moe is not None and plan.zero_stage == 3:
        try:  # AutoEP layers only, as DeepSpeed
            check_zero3_moe(moe)
        except ValueError as err:
            raise DeepSpeedConfigError(str(err)) from None
    _broadcast(module, plan, dist, moe)
    if moe is not None and plan.zero_stage == 3:  # experts partitioned over their expert-data-parallel group
        mark_zero3_placement(module, moe, dist)
    optimized_linear = apply_offload(module)
    timers: WallClockTimers | NullTimers = (
        WallClockTimers(get_accelerator().synchronize) if m.wall_clock_breakdown else NullTimers()
    )
    tp_size = tensor_parallel.size if tensor_parallel is not None else 1
    base = _base_optimizer(plan, config, module, client_optimizer, model_parameters, moe, tp_size)
    stepper, optimizer = _stepper(plan, config, base, module, dist, timers, moe, tensor_parallel)
    offload = build_parameter_offload(config, module, dist) if base is None and plan.zero_stage == 3 else None
    scheduler = _scheduler(config, client_scheduler, base, client_optimizer)
    monitor = build_monitor(config, rank=dist.global_rank)
    tp = m.timers.throughput
    throughput = ThroughputTimer(
        get_accelerator().synchronize if tp.synchronized else None, config.train_batch_size, enabled=tp.enabled
    )
    if m.wall_clock_breakdown and m.steps_per_print is None:
        logger.warning(
            "wall_clock_breakdown: timers are logged every steps_per_print steps, which is unset; read "
            "them with engine.get_wall_clock_timers()"
        )
    reporter = StepReporter(
        steps_per_print=m.steps_per_print,
        timers=timers,
        throughput=throughput,
        monitor=monitor,
        memory_breakdown=m.memory_breakdown,
    )
    loader: DeepSpeedDataLoader | CurriculumDataLoader | None = None
    if training_data is not None and m.data_efficiency.data_sampling.curriculum_learning.enabled:
        loader = make_curriculum_loader(
            training_data,
            data_efficiency_config=config.data_efficiency_config,
            batch_size=config.train_micro_batch_size_per_gpu,
            dist=dist,
            gradient_accumulation_steps=config.gradient_accumulation_steps,
            pin_memory=True,
            collate_fn=collate_fn,
            drop_last=m.dataloader_drop_last,
        )
    elif training_data is not None:
        loader = make_dataloader(
            training_data,
            batch_size=config.train_micro_batch_size_per_gpu,
            dp_world_size=dist.dp_world_size,
            dp_rank=dist.dp_rank,
            pin_memory=True,
            data_sampler=None,
            collate_fn=collate_fn,
            num_workers=0,
            drop_last=m.dataloader_drop_last,
            shuffle=shuffle_training_data,
        )
    return EngineParts(
        module=module,
        config=config,
        plan=plan,
        dist=dist,
        device=device,
        stepper=stepper,
        optimizer=optimizer,
        basic_optimizer=base,
        lr_scheduler=scheduler,
        training_dataloader=loader,
        timers=timers,
        reporter=reporter,
        monitor=monitor,
        collate_fn=collate_fn,
        parameter_offload=offload,
        tensor_parallel=tensor_parallel,
        autocast=AutocastPolicy(plan.device_type, plan.autocast_dtype is not None, plan.autocast_dtype),
        moe=moe,
        optimized_linear=optimized_linear,
    )
