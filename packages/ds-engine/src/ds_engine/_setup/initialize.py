"""`initialize()`, `add_config_arguments()`: DeepSpeed's entry points, with its argument rules."""

from __future__ import annotations

import argparse
import logging
import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim import Optimizer

import ds_comm
from ds_comm import get_accelerator
from ds_engine._checkpoint.deepspeed_layout import resolve_checkpoint_layout
from ds_engine._engine.assembly import AssemblyInputs, assemble
from ds_engine._engine.deepspeed_getters import ClientObjects
from ds_engine._engine.engine import DeepSpeedEngine
from ds_engine._hybrid.engine import DeepSpeedHybridEngine
from ds_engine._parallel.autoep import apply_autoep
from ds_engine._parallel.autoep_folding import FoldingFlags
from ds_engine._parallel.dims import (
    expected_replica_world_size,
    model_expert_degree,
    requested_degrees,
    resolve_parallel_layout,
)
from ds_engine._parallel.sequence_parallel import check_data_parallel_size, check_sequence_parallel
from ds_engine._parallel.tensor_parallel import (
    apply_autotp,
    check_tensor_parallel,
    publish_tensor_parallel_groups,
    tensor_parallel_partition_config,
)
from ds_engine._parallel.tp_model_init import merge_tp_model_init, refuse_group_with_mpu
from ds_engine._pipeline.build import build_pipeline_engine, check_pipeline_call, is_pipeline_module
from ds_engine._plan.plan import plan_assembly
from ds_engine._report.logging import set_log_level_from_string
from ds_engine._step.moe import is_expert_param, publish_moe_mpu
from ds_engine.config._constants import TORCH_DISTRIBUTED_DEFAULT_PORT

if TYPE_CHECKING:
    from ds_engine.config import DeepSpeedConfig

    ConfigLike = str | os.PathLike[str] | Mapping[str, Any] | DeepSpeedConfig

logger = logging.getLogger(__name__)

__all__ = ["DeepSpeedOptimizerCallable", "DeepSpeedSchedulerCallable", "add_config_arguments", "initialize"]

#: What `initialize(optimizer=...)` may be instead of an optimizer: a factory over the parameters (DeepSpeed's alias).
DeepSpeedOptimizerCallable = Callable[[Iterable[Any]], Optimizer]
#: What `initialize(lr_scheduler=...)` may be instead of a scheduler: a factory over the optimizer.
DeepSpeedSchedulerCallable = Callable[[Optimizer], Any]


def _config_source(args: Any, config: ConfigLike | None, config_params: ConfigLike | None) -> ConfigLike:
    from_args = None
    if args is not None:
        from_args = getattr(args, "deepspeed_config", None)
        legacy = getattr(args, "deepscale_config", None)
        if from_args is None and legacy is not None:
            warnings.warn("--deepscale_config is deprecated; use --deepspeed_config", FutureWarning, stacklevel=3)
            from_args = legacy
    given = {
        name: value
        for name, value in (("args.deepspeed_config", from_args), ("config", config), ("config_params", config_params))
        if value is not None
    }
    if len(given) > 1:
        raise ValueError(f"initialize(): pass the config once, got {' and '.join(given)}; they are alternatives")
    if not given:
        raise ValueError(
            "initialize() needs a config: config=<dict or path>, or --deepspeed_config on the command "
            "line (parsed into args)"
        )
    return next(iter(given.values()))


def _check_local_rank(args: Any) -> None:
    arg_rank = getattr(args, "local_rank", None) if args is not None else None
    env_rank = os.environ.get("LOCAL_RANK")
    if isinstance(arg_rank, int) and arg_rank >= 0 and env_rank is not None and int(env_rank) != arg_rank:
        raise ValueError(f"args.local_rank={arg_rank} disagrees with LOCAL_RANK={env_rank} from the launcher")


def _device(local_rank: int) -> torch.device:
    acc = get_accelerator()
    if acc.name == "cpu":
        return torch.device("cpu")
    acc.set_device(local_rank)
    return acc.device(local_rank)


def _read_config(source: ConfigLike, replica_world_size: int) -> DeepSpeedConfig:
    """The config validated, its batch triple resolved for `replica_world_size` data-parallel replicas."""
    from ds_engine.config import DeepSpeedConfig  # pydantic: loaded when a config is read

    if isinstance(source, DeepSpeedConfig):
        return source.with_world_size(replica_world_size)
    return DeepSpeedConfig(source, world_size=replica_world_size)


def _check_client_objects(model: Any, optimizer: Any, lr_scheduler: Any) -> None:
    if model is None:
        raise ds_comm.UsageError("initialize(): model is required (pass it as model=; the first positional is args)")
    if not isinstance(model, nn.Module):
        raise TypeError(f"initialize(): model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, Optimizer) and not callable(optimizer):
        raise TypeError(
            f"initialize(): optimizer must be a torch.optim.Optimizer or a callable(params), got "
            f"{type(optimizer).__name__}"
        )
    if lr_scheduler is not None and not hasattr(lr_scheduler, "step") and not callable(lr_scheduler):
        raise TypeError(
            f"initialize(): lr_scheduler must be a scheduler (with step()) or a callable(optimizer), got "
            f"{type(lr_scheduler).__name__}"
        )


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: Optimizer | Callable[..., Optimizer] | None = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable[..., Any] | None = None,
    config: ConfigLike | None = None,
    mesh_param: Any = None,
    config_params: ConfigLike | None = None,
) -> tuple[DeepSpeedEngine, Any, Any, Any]:
    """Wrap `model` for training as the config says; DeepSpeed's signature and rules.

    What happens, in order: the process group is created if needed (`init_distributed`, env or
    MPI discovery; `dist_init_required=False` with no group runs as a world of one); the config is
    read and validated (every problem raises here, before any work); then the model's parameters
    are cast to the training dtype and moved to this rank's device, broadcast from data-parallel
    rank 0, the base optimizer and its wrapper are built, and the lr scheduler and data loader
    are created. `ds-engine explain CONFIG` prints the same chain without building it.

    Args:
        args: an argparse namespace; `args.deepspeed_config` (or deprecated `deepscale_config`) names the config.
        model: the `torch.nn.Module` to train (required).
        optimizer: a torch optimizer (used as is), a callable `f(param_groups) -> Optimizer`, or None
            to build the config's `optimizer` section.
        model_parameters: parameters or param-group dicts for the optimizer (default `model.parameters()`).
        training_data: a Dataset; a distributed loader with the micro batch size is returned for it.
        lr_scheduler: a scheduler (needs a client optimizer), a callable `f(optimizer)`, or None for the config's.
        distributed_port: MASTER_PORT when the environment has none.
        mpu: a model-parallel unit (data-parallel group, model-parallel rank) for model-parallel setups;
            with a sequence-parallel degree (ALST's `register_with_transformers` returns one) gradients are
            reduced and ZeRO partitions over data x sequence ranks. Without one, `"sequence_parallel_size": N`
            in the config builds ds-parallel's mesh (the `parallel` extra), and so does
            `"tensor_parallel": {"autotp_size": N}`, which also shards the model with AutoTP (the mpu's
            model-parallel group is the tensor-parallel group when one is given); both set, one mesh has
            both dims (`ds_engine._parallel.dims`).
        dist_init_required: False to skip creating the process group.
        collate_fn: for the training data loader.
        config: a dict, a JSON/hjson path, base64 JSON, or a `DeepSpeedConfig` (with "auto" filled).
        mesh_param: not supported (must be None).
        config_params: alternative name for `config`.

    Returns:
        `(engine, optimizer, training_dataloader, lr_scheduler)`: the optimizer is the wrapper the
        engine steps (the base optimizer itself for fp32 at stage 0); the loader is None without
        `training_data`.

    Raises:
        DeepSpeedConfigError: any config problem, naming the key.
        ValueError / TypeError: bad arguments (no model, two configs, a client scheduler without a client optimizer).
        ImportError: the config needs ds-zero or ds-pipe, with the pip command that installs it.
    """
    _check_client_objects(model, optimizer, lr_scheduler)
    assert model is not None
    if mesh_param is not None:
        raise ValueError("initialize(): mesh_param (DeepSpeed's device mesh) is not supported by ds; pass mpu= instead")
    _check_local_rank(args)
    source = _config_source(args, config, config_params)
    refuse_group_with_mpu(mpu)
    ds_comm.init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required, verbose=False)
    pipeline = is_pipeline_module(model)
    if pipeline:
        check_pipeline_call(mpu)  # a PipelineModule's grid is the mpu: data parallel = its data axis
    given_mpu = model.mpu() if pipeline else mpu
    asked_tp, asked_sp = requested_degrees(source)  # the batch triple counts the replicas the degrees leave
    ds_config = _read_config(source, expected_replica_world_size(asked_tp, asked_sp, mpu=given_mpu))
    tp_init = merge_tp_model_init(ds_config)
    tp_size = tp_init.size
    if tp_size != ds_config.parsed.tensor_parallel.autotp_size:  # DeepSpeed writes tp_model_init's size into the config
        ds_config = ds_config.with_tensor_parallel_size(tp_size)
    sp = ds_config.parsed.sequence_parallel_size
    partition_config = None
    if tp_size > 1:
        check_tensor_parallel(ds_config, tp_size=tp_size, pipeline=pipeline)
        partition_config = tensor_parallel_partition_config(ds_config, tp_size)
    layout = resolve_parallel_layout(tp=tp_size, sp=sp, mpu=given_mpu, ep=model_expert_degree(model))
    dist = layout.dist
    if not pipeline:
        mpu = layout.mpu  # the client's, or the mesh's built for the config's degrees
    ds_config = ds_config.with_world_size(dist.replica_world_size)  # itself, unless a degree was coerced
    tp_state = None
    if tp_size > 1:
        publish_tensor_parallel_groups(mpu, dist, tp_size=tp_size, given_group=tp_init.tp_group)
        tp_state, model_parameters = apply_autotp(
            model,
            group=mpu.get_model_parallel_group(),
            tp_grain_size=ds_config.parsed.tensor_parallel.tensor_parallel.tp_grain_size,
            optimizer=optimizer,
            model_parameters=model_parameters,
            partition_config=partition_config,
        )
    if not pipeline:
        publish_moe_mpu(model, mpu)  # MoE layers lay their expert groups out around the model's tensor parallelism
    sp_given = "sequence_parallel_size" in ds_config.raw
    sp = check_sequence_parallel(sp, dist, pipeline=pipeline, given=sp_given)
    ds_config = ds_config.with_sequence_parallel_size(sp)  # itself, unless the mpu set an unset key
    autoep_report, model_parameters = apply_autoep(  # AutoEP: the MoE wiring below sees the converted layers
        model,
        ds_config.parsed.expert_parallel,
        dist,
        tp_size=tp_size,
        zero_stage=ds_config.zero.stage,
        pipeline=pipeline,
        model_parameters=model_parameters,
        client_optimizer=optimizer,
        zero_config=ds_config.zero.zero_config,
        tp_group=tp_state.group if tp_state is not None else None,
        folding=FoldingFlags.from_config(ds_config) if tp_size > 1 else None,
    )
    check_data_parallel_size(ds_config.parsed.data_parallel_size, with_sequence_parallel=sp_given, dist=dist)
    ds_config = resolve_checkpoint_layout(
        ds_config,
        pipeline=pipeline,
        tp_size=tp_size,
        mp_world_size=dist.mp_world_size,
        sp_size=sp,
        has_moe=any(is_expert_param(p) for p in model.parameters()),
        rank=dist.global_rank,
    )
    ds_config.check_resolved()
    from ds_engine.config import DeepSpeedConfigError  # loaded with the config above

    if ds_config.parsed.log_level is not None:
        set_log_level_from_string(ds_config.parsed.log_level)
    if "comms_logger" in ds_config.raw:
        ds_comm.configure(ds_config.parsed.comms_logger)
    plan = plan_assembly(
        ds_config,
        device_type=get_accelerator().name,
        client_optimizer=optimizer,
        client_scheduler=lr_scheduler,
        pipeline=pipeline,
    )
    device = _device(dist.local_rank)
    if pipeline and ds_config.parsed.flops_profiler.enabled:
        raise DeepSpeedConfigError(
            "flops_profiler.enabled: the flops profiler is not implemented for the PipelineEngine in ds "
            "(profile the stages' modules with ds_engine.profiling.flops_profiler.get_model_profile instead)"
        )
    if pipeline and ds_config.hybrid_engine.enabled:
        raise DeepSpeedConfigError(
            "hybrid_engine.enabled: the hybrid engine wraps a plain module, not a PipelineModule (DeepSpeed builds "
            "the PipelineEngine and ignores the section); switch it off for pipeline training"
        )
    if pipeline and not ds_config.parsed.managed_gradient_accumulation:
        raise DeepSpeedConfigError(
            "managed_gradient_accumulation=false is not supported with pipeline parallelism: the PipelineEngine's "
            "train_batch() runs the whole accumulation window itself; remove the key for a PipelineModule"
        )
    inputs = AssemblyInputs(
        module=model,
        config=ds_config,
        plan=plan,
        dist=dist,
        device=device,
        client_optimizer=optimizer,
        model_parameters=model_parameters,
        client_scheduler=lr_scheduler,
        training_data=training_data,
        collate_fn=collate_fn,
        tensor_parallel=tp_state,
    )
    if pipeline:
        built = build_pipeline_engine(inputs)
        built[0]._client = ClientObjects(
            mpu=model.mpu(), optimizer=optimizer, lr_scheduler=lr_scheduler, training_data=training_data
        )
        return built
    parts = assemble(inputs)
    engine = DeepSpeedHybridEngine(parts) if ds_config.hybrid_engine.enabled else DeepSpeedEngine(parts)
    engine.autoep_report = autoep_report
    engine._client = ClientObjects(mpu=mpu, optimizer=optimizer, lr_scheduler=lr_scheduler, training_data=training_data)
    if ds_config.parsed.dump_state and dist.global_rank == 0:
        logger.info("ds_engine.initialize: %r\n  %s", ds_config, "\n  ".join(plan.lines()))
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's `--deepspeed`, `--deepspeed_config` and the deprecated `--deepscale*` flags."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument(
        "--deepspeed",
        default=False,
        action="store_true",
        help="Enable DeepSpeed (helper flag for user code, no impact on ds_engine behaviour)",
    )
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument(
        "--deepscale",
        default=False,
        action="store_true",
        help="Deprecated enable DeepSpeed (helper flag for user code, no impact on behaviour)",
    )
    group.add_argument(
        "--deepscale_config", default=None, type=str, help="Deprecated DeepSpeed json configuration file."
    )
    return parser
