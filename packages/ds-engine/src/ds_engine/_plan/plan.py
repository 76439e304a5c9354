"""The wrapper chain initialize() will build, decided from the config alone (and shown by `ds-engine explain`).

Planning is pure: no parameters, devices or process groups are touched, so `explain` prints exactly
the decisions `initialize()` then carries out in `_engine/assembly.py`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import Optimizer

from ds_engine._optim.optimizers import OptimizerPlan, plan_config_optimizer
from ds_engine._plan.muon import muon_lines
from ds_engine._plan.reduce_settings import ReduceSettings
from ds_engine._plan.zenflow import zenflow_lines
from ds_engine.config import DeepSpeedConfigError
from ds_engine.config._dtype_names import to_torch_dtype

if TYPE_CHECKING:
    from ds_engine.config import DeepSpeedConfig

__all__ = ["AssemblyPlan", "plan_assembly", "reduction_dtype", "scales_autocast_loss"]

# `data_types.grad_accum_dtype` unset means the model's dtype, as in DeepSpeed 0.19.8 (`get_data_types`): bf16 at
# stage 0 then accumulates in the parameters' own bf16 `.grad` (DeepSpeed's FP16_Optimizer for bf16); fp32
# accumulation into the masters (DeepSpeed's BF16_Optimizer) is `"grad_accum_dtype": "fp32"`.
_DEFAULT_ACCUM = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16"}


@dataclasses.dataclass(frozen=True)
class AssemblyPlan:
    """Every decision initialize() makes from the config, before it builds anything."""

    device_type: str
    precision: str
    dtype: torch.dtype
    grad_accum_dtype: torch.dtype
    buffer_dtype: torch.dtype | None
    zero_stage: int
    offload_optimizer: bool
    optimizer_source: str
    """"config", "client", "client callable" or "none"."""
    optimizer: OptimizerPlan | None
    wrapper: str
    loss_scaler: str
    dynamic_loss_args: dict[str, Any] | None
    """Arguments of `ds_ops.precision.DynamicLossScaler` (fp16 with loss_scale 0), else None."""
    static_loss_scale: float
    check_overflow: bool
    clip: float
    reduce: ReduceSettings | None
    dp_world_size: int
    scheduler: str | None
    engine_class: str
    nvme_offload: str | None = None
    """What is swapped to NVMe and the async I/O settings (stage 3 with an "nvme" offload device), else None."""
    cpu_offload: tuple[str, ...] = ()
    """Stage 3 with offload to the CPU: partial offload (`offload_optimizer.ratio`) and SuperOffload choices."""
    autocast_dtype: torch.dtype | None = None
    """`torch_autocast` enabled: the dtype the forward autocasts to (the device's default when not given)."""
    immediate_grad_update: bool = False
    """bf16 at stage 0 with fp32 accumulation: each 16-bit gradient moves into the fp32 buffer as soon as
    backward has produced it (`bf16.immediate_grad_update`), not after the whole backward."""
    keep_in_fp32_modules: str | tuple[str, ...] = "auto"
    """`data_types.keep_in_fp32_modules`: "auto" or name patterns of buffers kept in fp32 under fp16/bf16."""
    muon: tuple[str, ...] = ()
    """With `"optimizer": {"type": "Muon"}`: how each Muon choice is carried out (`_plan.muon`)."""
    zenflow: tuple[str, ...] = ()
    """With `zero_optimization.zenflow`: the resolved selection and update schedule (`_plan.zenflow`)."""
    bf16_masters: bool = False
    """ZeRO keeps bf16 master weights and gradient partitions (`bf16.bf16_master_weights_and_grads`) instead of
    fp32 ones."""
    bf16_optimizer_states: bool = False
    """With `bf16_masters`: the optimizer's moments in bf16 too (`bf16.bf16_optimizer_states`); without it they
    stay fp32 in the CPU Adam of the optimizer offload."""
    masters_on_nvme: bool = False
    """The optimizer is offloaded to NVMe (`offload_optimizer.device: nvme`): the masters are paged from swap files."""
    fp16_masters: bool = False
    """ZeRO keeps fp16 master weights and gradient partitions on the host, fp32 moments in DeepSpeedCPUAdam
    (`fp16.fp16_master_weights_and_grads`)."""
    checkpoint_writer: str = "torch.save to a temporary file, published atomically (checkpoint.writer unset)"
    """How `save_checkpoint` writes its files (`checkpoint.writer`, FastPersist)."""

    def _bf16_masters_text(self) -> str:
        """Where the bf16 masters live and what their moments are, with the model-state bytes per element."""
        where = "on the CPU, stepped by DeepSpeedCPUAdam" if self.offload_optimizer else "on the device"
        if self.masters_on_nvme:
            where = "on NVMe (swap files of that width, paged through the CPU), stepped by DeepSpeedCPUAdam"
        if self.bf16_optimizer_states:
            return (
                f"master weights, gradient partitions and optimizer states in bf16 {where} (8 bytes per "
                "partitioned element instead of 16; bf16.bf16_master_weights_and_grads + bf16.bf16_optimizer_states)"
            )
        return (
            f"master weights and gradient partitions in bf16 {where}, Adam moments fp32 (12 bytes per partitioned "
            "element instead of 16; bf16.bf16_master_weights_and_grads, bf16.bf16_optimizer_states off)"
        )

    def lines(self) -> list[str]:
        """The chain, one line per link, for `explain` and `dump_state`."""
        cast = (
            "parameters stay fp32"
            if self.precision == "fp32"
            else f"parameters cast to {self.precision} once (buffers {self.buffer_dtype or 'keep their dtype'})"
        )
        if self.optimizer is not None:
            base = self.optimizer.describe()
        else:
            base = {
                "client": "the client optimizer, as passed",
                "client callable": "the client callable(params)",
                "none": "none (no optimizer in the config or the call: forward/eval only)",
            }[self.optimizer_source]
        if self.autocast_dtype is not None:
            cast += f"; forward under torch.autocast({str(self.autocast_dtype).replace('torch.', '')})"
        out = [f"device: {self.device_type}; {cast}", f"base optimizer: {base}"]
        if self.optimizer is not None and self.optimizer.fallback is not None:
            out.append(f"  if it cannot load here: {self.optimizer.fallback.describe()}")
        accum = str(self.grad_accum_dtype).replace("torch.", "")
        out.append(f"wrapper: {self.wrapper}")
        if self.bf16_masters:
            out.append(f"  {self._bf16_masters_text()}")
        if self.fp16_masters:
            out.append(
                "  master weights and gradient partitions in fp16 on the CPU, stepped by DeepSpeedCPUAdam with fp32 "
                "moments (12 bytes per partitioned element instead of 16; fp16.fp16_master_weights_and_grads)"
            )
        out.append(
            f"  loss scaler: {self.loss_scaler}; overflow check: {'on' if self.check_overflow else 'off'}; "
            f"gradient accumulation in {accum}"
            + (" (each gradient moved in during backward)" if self.immediate_grad_update else "")
            + "; clip global norm: "
            f"{self.clip:g}" + (" (off)" if self.clip == 0 else "")
        )
        if self.nvme_offload is not None:
            out.append(f"  {self.nvme_offload}")
        out += [f"  {line}" for line in self.cpu_offload]
        out += [f"  {line}" for line in self.muon]
        out += [f"  {line}" for line in self.zenflow]
        if self.zero_stage == 0:
            reduce = (
                self.reduce.describe(self.dp_world_size)
                if self.reduce is not None
                else "no gradient all-reduce (one data-parallel rank)"
            )
            out.append(f"  data parallel: {reduce}")
        out.append(f"lr scheduler: {self.scheduler or 'none'}")
        out.append(f"engine: {self.engine_class}")
        out.append(f"checkpoint files: {self.checkpoint_writer}")
        return out


def _scheduler_text(config: DeepSpeedConfig, client_scheduler: object | None) -> str | None:
    if client_scheduler is not None:
        kind = (
            "callable(optimizer)"
            if callable(client_scheduler) and not hasattr(client_scheduler, "step")
            else type(client_scheduler).__name__
        )
        return f"client {kind}, stepped after each applied optimizer step"
    sched = config.parsed.scheduler
    if sched is None:
        return None
    args = ", ".join(f"{k}={v!r}" for k, v in sched.params.items())
    return f"{sched.type}({args}), stepped after each applied optimizer step"


def _plan_optimizer(
    config: DeepSpeedConfig, client_optimizer: object | None, device_type: str, offload: bool
) -> tuple[str, OptimizerPlan | None]:
    if isinstance(client_optimizer, Optimizer):
        return "client", None
    if client_optimizer is not None:
        return "client callable", None
    opt = config.parsed.optimizer
    if opt is None:
        return "none", None
    try:
        plan = plan_config_optimizer(
            opt.type,
            dict(opt.params),
            device_type=device_type,
            offload=offload,
            force_ds_cpu_optimizer=config.parsed.zero_force_ds_cpu_optimizer,
            bf16_optimizer_states=config.parsed.bf16.bf16_optimizer_states,
            zenflow=getattr(config.zero.zero_config, "zenflow", None) is not None,
        )
    except ValueError as err:
        raise DeepSpeedConfigError(f"optimizer: {err}") from None
    masters = [
        key
        for key, on in (
            ("bf16.bf16_master_weights_and_grads", config.parsed.bf16.bf16_master_weights_and_grads),
            ("fp16.fp16_master_weights_and_grads", config.parsed.fp16.fp16_master_weights_and_grads),
        )
        if on
    ]
    if offload and masters and plan.target != "ds_ops.DeepSpeedCPUAdam":
        raise DeepSpeedConfigError(
            f"{masters[0]}=true with optimizer offload needs DeepSpeedCPUAdam (as in DeepSpeed), "
            f"but optimizer.type={opt.type!r} builds {plan.target}; use Adam/AdamW without optimizer.params.torch_adam"
        )
    return "config", plan


def _autocast_dtype(config: DeepSpeedConfig, device_type: str) -> torch.dtype | None:
    section = config.parsed.torch_autocast
    if not section.enabled:
        return None
    return to_torch_dtype(section.dtype) if section.dtype is not None else torch.get_autocast_dtype(device_type)


def scales_autocast_loss(plan: AssemblyPlan) -> bool:
    """fp16 autocast over fp32 parameters: the fp32 stepper scales the loss (the `fp16` section's scaler
    settings), as DeepSpeed gives that case a `torch.amp.GradScaler`."""
    return plan.precision == "fp32" and plan.autocast_dtype == torch.float16


def _loss_scaling(
    config: DeepSpeedConfig, autocast: torch.dtype | None, stage: int
) -> tuple[str, dict[str, Any] | None, float]:
    """The scaler's description, its `DynamicLossScaler` arguments (None: static) and the static scale.

    At ZeRO stage 0 with fp16 parameters DeepSpeed 0.19.8 steps with its FP16_Optimizer, whose own scale
    update lowers the scale at every overflow: `fp16.hysteresis` applies only to ZeRO's scaler. ds does the
    same (hysteresis 1 at stage 0), so a stage-0 run skips the same steps as DeepSpeed's.
    """
    fp16 = config.parsed.fp16
    if config.precision != "fp16" and not (autocast == torch.float16 and config.precision == "fp32"):
        return "static 1.0 (no scaling)", None, 1.0
    if fp16.dynamic_loss_scale:
        args = fp16.dynamic_loss_args()
        hysteresis = f"{fp16.hysteresis}{' (consecutive)' if fp16.consecutive_hysteresis else ''}"
        if stage == 0 and config.precision == "fp16":
            args.update(delayed_shift=1, consecutive_hysteresis=False)
            hysteresis = "not applied at ZeRO stage 0 (lowered at every overflow, as DeepSpeed's fp16 optimizer)"
        text = (
            f"dynamic: start 2**{fp16.initial_scale_power}, window {fp16.loss_scale_window}, hysteresis "
            f"{hysteresis}, min {fp16.min_loss_scale:g}"
        )
        return text, args, 0.0
    return f"static {fp16.loss_scale:g}", None, fp16.loss_scale


def _nvme_text(config: DeepSpeedConfig) -> str | None:
    z = config.zero
    swapped = [
        f"{what} under {getattr(z.zero_config, f'{key}_or_default').nvme_path}"
        for key, what in (("offload_param", "parameter partitions"), ("offload_optimizer", "optimizer state"))
        if getattr(z, f"{key}_device") == "nvme"
    ]
    if not swapped:
        return None
    a = config.parsed.aio
    return (
        f"NVMe offload (ZeRO-Infinity): {' and '.join(swapped)}; aio: block_size={a.block_size}, "
        f"queue_depth={a.queue_depth}, intra_op_parallelism={a.intra_op_parallelism}, "
        f"single_submit={a.single_submit}, overlap_events={a.overlap_events}"
    )


def _cpu_offload_lines(config: DeepSpeedConfig, device_type: str) -> tuple[str, ...]:
    """What stage 3 does with `offload_optimizer.ratio` and `super_offload` (device "cpu")."""
    z = config.zero
    if z.stage != 3 or z.offload_optimizer_device != "cpu":
        return ()
    off = z.zero_config.offload_optimizer_or_default
    lines = []
    if off.ratio < 1.0:
        lines.append(
            f"partial offload (offload_optimizer.ratio={off.ratio:g}): of the n sub-groups (sub_group_size="
            f"{int(z.zero_config.sub_group_size)} elements, in the optimizer's order) the first "
            f"int({1 - off.ratio:g} * n) keep their fp32 master and optimizer state on the accelerator ({device_type}) "
            "and are stepped there; the rest are offloaded to the CPU"
        )
    if off.super_offload:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = max(1, cores - int((1.0 - off.cpuadam_cores_perc) * cores))
        clip = config.parsed.gradient_clipping
        lines.append(
            "SuperOffload (offload_optimizer.super_offload): on the backward that ends the accumulation window each "
            "CPU sub-group is stepped as soon as its gradient is complete, on a worker thread with "
            f"{threads} of {cores} cores (cpuadam_cores_perc={off.cpuadam_cores_perc:g}), overlapping the rest of the "
            "backward; a step skipped for an inf/nan gradient undoes those updates"
            + (f", a step clipped to gradient_clipping={clip:g} undoes and redoes them" if clip > 0 else "")
        )
    return tuple(lines)


def _checkpoint_writer_text(config: DeepSpeedConfig, pipeline: bool) -> str:
    w = config.parsed.checkpoint.writer
    if w is None:
        return AssemblyPlan.checkpoint_writer
    if w.type == "FAST":
        a = config.parsed.aio
        halves = "two halves" if w.io_buffer_double else "one"
        what = (
            f"FastPersist writer (checkpoint.writer.type=FAST): torch.save through an aligned {w.io_buffer_size}-byte "
            f"buffer ({halves}) and the async I/O op (aio block_size={a.block_size}, queue_depth={a.queue_depth}, "
            f"intra_op_parallelism={a.intra_op_parallelism})"
        )
    else:
        what = "torch.save through a Python file (checkpoint.writer.type=PYTHON)"
    if w.data_parallel != "REPLICA":
        who = "data-parallel rank 0 writes the model states"
    elif config.world_size * config.parsed.sequence_parallel_size <= 1:
        who = "data_parallel=REPLICA has one data-parallel rank here: it writes the model states alone"
    elif pipeline:
        who = "data_parallel=REPLICA is off in the pipeline engine: each stage's data-parallel rank 0 writes its states"
    elif config.zero.stage >= 3:
        who = "data_parallel=REPLICA is off at ZeRO stage 3 (model states differ per rank): rank 0 writes them"
    else:
        who = (
            "data_parallel=REPLICA: every data-parallel rank writes stripes of the model-states file "
            "(rank 0 alone for a model with MoE layers and in the pipeline engine)"
        )
    when = (
        "; decoupled: a background worker writes a snapshot of each file (pipeline layer and MoE expert files "
        "too; save_16bit_model's file is written before it returns, as DeepSpeed commits it at once) and "
        "`latest` moves once every rank's files are written (at a step boundary, the next save/load, "
        "commit_checkpoint() or destroy())"
        if w.decoupled
        else ""
    )
    return f"{what}; {who}; every file published atomically{when}"


def _check_overflow(precision: str, stage: int, bf16_check: bool) -> bool:
    """Whether steps with inf/nan gradients are skipped: always for fp16, `bf16.check_grad_overflow` for
    bf16, and for fp32 under ZeRO (ds-zero always skipped them there; stage 0's fp32 step never checks)."""
    if precision == "fp16":
        return True
    if precision == "bf16":
        return bf16_check
    return stage >= 1


def reduction_dtype(config: DeepSpeedConfig) -> torch.dtype | None:
    """The gradient reductions' dtype: `seq_parallel_communication_data_type` when sequence parallelism is
    on (as DeepSpeed does), else `communication_data_type` (None: the accumulation dtype)."""
    m = config.parsed
    if m.sequence_parallel_size > 1:
        return to_torch_dtype(m.seq_parallel_communication_data_type)
    return to_torch_dtype(m.communication_data_type) if m.communication_data_type else None


def plan_assembly(
    config: DeepSpeedConfig,
    *,
    device_type: str,
    client_optimizer: object | None = None,
    client_scheduler: object | None = None,
    pipeline: bool = False,
) -> AssemblyPlan:
    """Decide the chain for `config` on `device_type` ("cpu" or "cuda").

    Raises:
        DeepSpeedConfigError: an optimizer choice that cannot work here (see `plan_config_optimizer`).
    """
    m = config.parsed
    precision = config.precision
    accum = m.data_types.grad_accum_dtype or _DEFAULT_ACCUM[precision]
    stage = config.zero.stage
    offload = config.zero.offload_optimizer_device != "none"
    where = "NVMe" if config.zero.offload_optimizer_device == "nvme" else "CPU"
    source, opt_plan = _plan_optimizer(config, client_optimizer, device_type, offload)
    muon = muon_lines(config, opt_plan.kwargs, stage) if opt_plan is not None and opt_plan.name == "muon" else ()
    if stage == 3 and source == "none":
        wrapper = (
            "ds_zero.DeepSpeedZeRoOffload (ZeRO stage 3 without an optimizer: parameters partitioned and "
            "gathered per module for evaluation; backward/step refused)"
        )
    elif stage >= 1 and source == "none":
        wrapper = f"none: ZeRO stage {stage} needs an optimizer; initialize() refuses this config without optimizer="
    elif stage >= 1:
        zenflow = getattr(config.zero.zero_config, "zenflow", None) is not None
        name = "DeepSpeedZeroOptimizer_Stage3" if stage == 3 else "DeepSpeedZeroOptimizer"
        if zenflow:
            name = "ZenFlowZeroOptimizer_Stage3" if stage == 3 else "ZenFlowZeroOptimizer"
        wrapper = f"ds_zero.{name} (ZeRO stage {stage}{f', optimizer offload to {where}' if offload else ''})"
    elif precision == "fp32":
        wrapper = "none: the base optimizer is stepped directly"
    else:
        wrapper = f"MixedPrecisionOptimizer ({precision} parameters, fp32 master weights)"
    autocast = _autocast_dtype(config, device_type)
    if autocast is not None and pipeline:
        raise DeepSpeedConfigError(
            "torch_autocast.enabled: torch autocast is not implemented for the pipeline engine in ds; use bf16 or fp16"
        )
    scaler_text, dynamic_args, static_scale = _loss_scaling(config, autocast, stage)
    world = config.world_size
    reduce = None
    comm_dtype = reduction_dtype(config)
    # Sequence-parallel peers hold the same parameters too: gradients are reduced over data x sequence ranks.
    if stage == 0 and world * m.sequence_parallel_size > 1:
        reduce = ReduceSettings(
            bucket_numel=config.zero.reduce_bucket_size,
            average=m.gradient_allreduce_op == "mean",
            prescale=m.prescale_gradients,
            predivide=m.gradient_predivide_factor,
            comm_dtype=comm_dtype,
        )
    return AssemblyPlan(
        device_type=device_type,
        precision=precision,
        dtype=to_torch_dtype(precision),
        grad_accum_dtype=to_torch_dtype(accum),
        buffer_dtype=to_torch_dtype(m.data_types.buffer_dtype) if m.data_types.buffer_dtype else None,
        zero_stage=stage,
        offload_optimizer=offload,
        optimizer_source=source,
        optimizer=opt_plan,
        wrapper=wrapper,
        loss_scaler=scaler_text,
        dynamic_loss_args=dynamic_args,
        static_loss_scale=static_scale,
        check_overflow=_check_overflow(precision, stage, m.bf16.check_grad_overflow)
        or (precision == "fp32" and autocast == torch.float16),
        clip=m.gradient_clipping,
        reduce=reduce,
        dp_world_size=world,
        scheduler=_scheduler_text(config, client_scheduler),
        engine_class=(
            "PipelineEngine" if pipeline else "DeepSpeedHybridEngine" if m.hybrid_engine.enabled else "DeepSpeedEngine"
        ),
        nvme_offload=_nvme_text(config),
        cpu_offload=_cpu_offload_lines(config, device_type),
        checkpoint_writer=_checkpoint_writer_text(config, pipeline),
        autocast_dtype=autocast,
        immediate_grad_update=precision == "bf16" and stage == 0 and m.bf16.immediate_grad_update,
        bf16_masters=stage >= 1 and m.bf16.bf16_master_weights_and_grads,
        bf16_optimizer_states=stage >= 1 and m.bf16.bf16_optimizer_states,
        masters_on_nvme=config.zero.offload_optimizer_device == "nvme",
        fp16_masters=stage >= 1 and m.fp16.fp16_master_weights_and_grads,
        muon=muon,
        zenflow=zenflow_lines(config) if stage >= 1 and source != "none" else (),
        keep_in_fp32_modules=(keep if isinstance(keep := m.data_types.keep_in_fp32_modules, str) else tuple(keep)),
    )
