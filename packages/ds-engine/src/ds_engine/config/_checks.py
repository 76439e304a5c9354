"""Cross-field checks: settings that are each valid alone but not together. Run before any work starts."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ds_comm import find_ignored
from ds_engine._optim.optimizers import is_zero_tested_optimizer
from ds_engine.config._errors import DeepSpeedConfigError, ParamDtypeConflictError
from ds_engine.config._types import dtype_name

if TYPE_CHECKING:
    from ds_engine.config._toplevel import DeepSpeedConfigModel
    from ds_engine.config._zero_section import ZeroSettings

logger = logging.getLogger(__name__)

__all__ = [
    "check_cross_fields",
    "check_param_dtype",
    "check_sum_allreduce_conflicts",
    "precision_name",
    "warn_keys_without_effect",
]

# (model dtype, accumulation dtype) pairs the stage-0 wrappers implement.
_ACCUM_OK = {("fp32", "fp32"), ("fp16", "fp16"), ("fp16", "fp32"), ("bf16", "bf16"), ("bf16", "fp32")}


def check_param_dtype(param_dtype: str | None, *, fp16: bool, bf16: bool) -> None:
    """`data_types.param_dtype`, when given, must name the dtype the fp16/bf16 switches train in.

    The wrappers (master weights, loss scaling, reductions) follow the switches, so a different
    parameter dtype would train in a mode none of them implements.

    Raises:
        ParamDtypeConflictError: they disagree (a `ValueError` and an `AssertionError`).
    """
    mode = "fp16" if fp16 else "bf16" if bf16 else "fp32"
    if param_dtype is not None and dtype_name(param_dtype) != mode:
        raise ParamDtypeConflictError(
            f"data_types.param_dtype={param_dtype!r} conflicts with the precision mode ({mode}: "
            f"fp16.enabled={fp16}, bf16.enabled={bf16}); drop it or make them agree"
        )


def precision_name(model: DeepSpeedConfigModel) -> str:
    """ "fp16", "bf16" or "fp32": the dtype parameters are trained in."""
    if model.fp16.enabled:
        return "fp16"
    if model.bf16.enabled:
        return "bf16"
    return "fp32"


def check_sum_allreduce_conflicts(raw: Mapping[str, Any]) -> None:
    """Refuse `gradient_allreduce_op='sum'` with ZenFlow or DeepCompile, naming that conflict as DeepSpeed does.

    ZenFlow averages each micro step's gradients (its selective update reads the mean), so a sum is
    refused as DeepSpeed refuses it. DeepSpeed refuses 'sum' with DeepCompile, and so does ds. It reads
    the raw dict because it must run before the sections are validated.

    Raises:
        DeepSpeedConfigError: 'sum' with a `zero_optimization.zenflow` section or with `compile.deepcompile` on.
    """
    op = raw.get("gradient_allreduce_op")
    if not (isinstance(op, str) and op.lower() == "sum"):
        return
    zero = raw.get("zero_optimization")
    if isinstance(zero, Mapping) and zero.get("zenflow") is not None:
        raise DeepSpeedConfigError(
            "gradient_allreduce_op='sum' is not supported with ZenFlow (zero_optimization.zenflow); use 'mean' "
            "or remove the zenflow section"
        )
    compile_section = raw.get("compile")
    if isinstance(compile_section, Mapping) and compile_section.get("deepcompile"):
        raise DeepSpeedConfigError(
            "gradient_allreduce_op='sum' is not supported with DeepCompile (compile.deepcompile=true); "
            "use 'mean' (the default)"
        )


def _check_dtypes(model: DeepSpeedConfigModel, zero: ZeroSettings) -> None:
    dtype = precision_name(model)
    types = model.data_types
    check_param_dtype(types.param_dtype, fp16=model.fp16.enabled, bf16=model.bf16.enabled)
    accum = types.grad_accum_dtype
    if accum is not None and zero.stage == 0 and (dtype, accum) not in _ACCUM_OK:
        allowed = sorted(a for d, a in _ACCUM_OK if d == dtype)
        raise DeepSpeedConfigError(
            f"data_types.grad_accum_dtype={accum!r} is not supported with {dtype} parameters at ZeRO stage 0; "
            f"use one of {allowed}"
        )


_MASTERS = "bf16.bf16_master_weights_and_grads"
_STATES = "bf16.bf16_optimizer_states"


def _check_bf16_masters(model: DeepSpeedConfigModel, zero: ZeroSettings) -> None:
    """bf16 master weights / optimizer states: DeepSpeed's refusals (ZeRO stage 1-3 only; optimizer states need
    the masters; fp32 moments beside bf16 masters need CPU optimizer offload), and what ds does not implement
    (bf16 training off). ds-zero checks the same again, with the base optimizer's class
    (DeepSpeedCPUAdam under offload), when its optimizer is built."""
    bf16 = model.bf16
    masters, states = bf16.bf16_master_weights_and_grads, bf16.bf16_optimizer_states
    if not (masters or states):
        return
    key = _MASTERS if masters else _STATES
    if zero.stage not in (1, 2, 3):
        raise DeepSpeedConfigError(
            f"{key}=true is only supported with ZeRO stage 1, 2 or 3 (zero_optimization.stage={zero.stage}); "
            "set zero_optimization.stage, or turn it off"
        )
    if states and not masters:
        raise DeepSpeedConfigError(
            f"{_STATES}=true needs {_MASTERS}=true (the moments follow the master weights' dtype); set {_MASTERS} "
            f"to true as well, or drop {_STATES}"
        )
    if not bf16.enabled:
        raise DeepSpeedConfigError(
            f"{_MASTERS}=true applies to bf16 training: set bf16.enabled=true (ds keeps bf16 masters only over "
            "a bf16 model), or turn it off"
        )
    offload = zero.offload_optimizer_device
    if not states and offload == "none":
        raise DeepSpeedConfigError(
            f"{_MASTERS}=true with {_STATES}=false keeps fp32 moments beside bf16 masters, which needs "
            "zero_optimization.offload_optimizer.device 'cpu' or 'nvme' with DeepSpeedCPUAdam (as in DeepSpeed): "
            f"offload the optimizer, or set {_STATES} to true as well"
        )


_FP16_MASTERS = "fp16.fp16_master_weights_and_grads"


def _check_fp16_masters(model: DeepSpeedConfigModel, zero: ZeroSettings) -> None:
    """fp16 master weights: DeepSpeed's rules (ZeRO stage 1-3 with CPU optimizer offload, or NVMe at stage 3, and
    DeepSpeedCPUAdam; not with the bf16 master options), fp16 training on. ds-zero checks again with the base
    optimizer's class."""
    if not model.fp16.fp16_master_weights_and_grads:
        return
    if not model.fp16.enabled:
        raise DeepSpeedConfigError(
            f"{_FP16_MASTERS}=true applies to fp16 training: set fp16.enabled=true, or turn it off"
        )
    if model.bf16.bf16_master_weights_and_grads or model.bf16.bf16_optimizer_states:
        raise DeepSpeedConfigError(
            f"{_FP16_MASTERS}=true and {_MASTERS} / {_STATES} exclude each other (as in DeepSpeed); drop the bf16 ones"
        )
    if zero.stage not in (1, 2, 3) or zero.offload_optimizer_device not in ("cpu", "nvme"):
        raise DeepSpeedConfigError(
            f"{_FP16_MASTERS}=true keeps fp32 moments beside fp16 masters on the host, which needs ZeRO stage 1, 2 "
            "or 3 with zero_optimization.offload_optimizer.device 'cpu' (or 'nvme' at stage 3) and DeepSpeedCPUAdam "
            f"(as in DeepSpeed); got stage {zero.stage}, offload_optimizer.device {zero.offload_optimizer_device!r}"
        )


def _check_legacy_fusion(model: DeepSpeedConfigModel, zero: ZeroSettings) -> None:
    """`optimizer.legacy_fusion` selects DeepSpeed's legacy fused fp16 step, which it reaches only with fp16 at ZeRO
    stage 0 and which fails there at the first step in DeepSpeed 0.19.8 (its FusedAdam refuses the legacy
    arguments). Elsewhere DeepSpeed never reads it: the section's `ignored_keys` warns."""
    opt = model.optimizer
    if opt is not None and opt.legacy_fusion and model.fp16.enabled and zero.stage == 0:
        raise DeepSpeedConfigError(
            "optimizer.legacy_fusion=true with fp16 at ZeRO stage 0 selects DeepSpeed's legacy fused fp16 step, "
            "which DeepSpeed 0.19.8 cannot run either (its FusedAdam no longer takes the legacy gradients and "
            "scale arguments); set optimizer.legacy_fusion to false"
        )


def _check_nvme(model: DeepSpeedConfigModel, zero: ZeroSettings) -> None:
    nvme = [
        key
        for key, device in (
            ("offload_param", zero.offload_param_device),
            ("offload_optimizer", zero.offload_optimizer_device),
        )
        if device == "nvme"
    ]
    if nvme and zero.stage != 3:
        raise DeepSpeedConfigError(
            f"zero_optimization.{nvme[0]}.device='nvme': NVMe offload (ZeRO-Infinity) needs zero_optimization.stage=3, "
            f"got {zero.stage}; use device 'cpu' at stages 1 and 2"
        )
    if not nvme and "aio" in model.model_fields_set:
        logger.warning(
            "aio: the section has no effect without NVMe offload (zero_optimization.offload_param or "
            "offload_optimizer with device 'nvme')"
        )


def _check_unmanaged_accumulation(model: DeepSpeedConfigModel, zero: ZeroSettings) -> None:
    """With `managed_gradient_accumulation: false`, stages 0 and 1 reduce once, in `step()`: nothing to overlap.

    Stages 2 and 3 still reduce during each backward, so their `overlap_comm` keeps its meaning.
    """
    overlap = bool(getattr(zero.zero_config, "overlap_comm", False))
    if not model.managed_gradient_accumulation and zero.stage < 2 and overlap:
        raise DeepSpeedConfigError(
            f"managed_gradient_accumulation=false supports zero_optimization.overlap_comm only with ZeRO stage 2 "
            f"or 3 (stage {zero.stage} reduces the gradients once, in step()); set "
            f"zero_optimization.overlap_comm to false or keep managed_gradient_accumulation true"
        )


#: Sections whose keys without effect are reported where the section is read (only when it is switched on).
_WARNED_WHERE_READ = ("hybrid_engine",)


def warn_keys_without_effect(model: DeepSpeedConfigModel) -> None:
    """One `UserWarning` per key (top level or in a section model) that DeepSpeed reads and ds does not act on,
    when set to anything but its default: "<key path>=<value> has no effect in ds (<why>)" (as
    `ds_comm.warn_ignored`, the models' `ignored_keys`)."""
    for key, value, reason in find_ignored(model):
        if key.split(".", 1)[0] not in _WARNED_WHERE_READ:
            warnings.warn(f"{key}={value!r} has no effect in ds ({reason})", UserWarning, stacklevel=3)


def check_cross_fields(model: DeepSpeedConfigModel, zero: ZeroSettings) -> None:
    """Refuse contradictory settings; warn once about settings that have no effect.

    Raises:
        DeepSpeedConfigError: naming every key involved and the fix.
    """
    if model.fp16.enabled and model.bf16.enabled:
        raise DeepSpeedConfigError(
            "fp16.enabled and bf16.enabled are both true; enable one of them "
            "(bf16 is the safer choice where the hardware supports it)"
        )
    _check_dtypes(model, zero)
    _check_bf16_masters(model, zero)
    _check_fp16_masters(model, zero)
    opt = model.optimizer
    if (
        zero.stage >= 1
        and opt is not None
        and not is_zero_tested_optimizer(opt.type)
        and not model.zero_allow_untested_optimizer
    ):
        raise DeepSpeedConfigError(
            f"optimizer.type={opt.type!r} is not tested with ZeRO (stage {zero.stage}); tested: Adam, AdamW, "
            'Adagrad, Lamb, Lion. Set "zero_allow_untested_optimizer": true to use it anyway'
        )
    if opt is not None and opt.type == "lamb" and model.fp16.enabled and not model.fp16.dynamic_loss_scale:
        raise DeepSpeedConfigError(
            f"optimizer.type='lamb' with fp16 needs dynamic loss scaling; set "
            f"fp16.loss_scale to 0 (it is {model.fp16.loss_scale})"
        )
    if model.gradient_allreduce_op == "sum" and zero.stage == 3:
        raise DeepSpeedConfigError("gradient_allreduce_op='sum' is not supported with ZeRO stage 3; use 'mean'")
    _check_nvme(model, zero)
    _check_unmanaged_accumulation(model, zero)
    _check_legacy_fusion(model, zero)
    if model.fp16.auto_cast and not model.fp16.enabled:
        warnings.warn("fp16.auto_cast has no effect while fp16.enabled is false", UserWarning, stacklevel=3)
    if model.prescale_gradients and model.gradient_predivide_factor != 1.0:
        warnings.warn(
            "gradient_predivide_factor has no effect with prescale_gradients=true (gradients are "
            "divided by the data-parallel size before the all-reduce)",
            UserWarning,
            stacklevel=3,
        )
    if model.data_parallel_size is not None and "sequence_parallel_size" not in model.model_fields_set:
        warnings.warn(
            f"data_parallel_size={model.data_parallel_size} has no effect without sequence_parallel_size: DeepSpeed "
            "reads it only to build its (data, sequence) mesh; the data-parallel degree is the world size over "
            "the other parallel degrees",
            UserWarning,
            stacklevel=3,
        )
    if model.vocabulary_size is not None and model.vocabulary_size % 8:
        logger.warning(
            "vocabulary_size=%d is not a multiple of 8; padding it to %d is faster on tensor cores",
            model.vocabulary_size,
            (model.vocabulary_size + 7) // 8 * 8,
        )
