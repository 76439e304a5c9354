"""`zero_optimization`: the legacy bool form, offload devices, and validation by ds-zero (an optional extra).

An enabled `zenflow` section is checked here, at config time, before anything is built
(`_zenflow_checks`): ds runs it at stages 1, 2 and 3 with CPU optimizer offload.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Any

from ds_comm import ConfigDeprecationWarning, ConfigError, validate_section, warn_ignored
from ds_engine._optional import require
from ds_engine.config._errors import DeepSpeedConfigError
from ds_engine.config._zenflow_checks import check_zenflow

logger = logging.getLogger(__name__)

__all__ = ["ZeroSettings", "resolve_zero"]

_DEFAULT_BUCKET_NUMEL = 500_000_000

ZENFLOW_NEEDS_ZERO = (
    "zero_optimization.zenflow needs ds-zero (ZeRO with CPU optimizer offload): "
    "pip install 'ds-engine[zero]', or remove the section"
)


@dataclasses.dataclass(frozen=True)
class ZeroSettings:
    """What the engine needs from `zero_optimization`, plus ds-zero's validated model when installed."""

    stage: int = 0
    offload_optimizer_device: str = "none"
    offload_param_device: str = "none"
    reduce_bucket_size: int = _DEFAULT_BUCKET_NUMEL
    load_from_fp32_weights: bool = True
    gather_16bit_weights_on_model_save: bool = False
    zero_config: Any = None
    """The `ds_zero.ZeroConfig` instance, or None when ds-zero is not installed (stage 0 only)."""
    unavailable: str | None = None
    """Why the requested stage cannot run here (ds-zero missing); DeepSpeedConfig raises it after the
    cross-field checks, so those report the same way with or without ds-zero."""


def _stage_of(section: dict[str, Any]) -> int:
    stage = section.get("stage", 0)
    try:
        stage = int(stage) if not isinstance(stage, bool) else -1
    except (TypeError, ValueError):
        stage = -1
    if stage not in (0, 1, 2, 3):
        raise DeepSpeedConfigError(f"zero_optimization.stage: must be 0, 1, 2 or 3, got {section.get('stage')!r}")
    return stage


def _offload_device(section: dict[str, Any], key: str) -> str:
    value = section.get(key)
    legacy = {"offload_optimizer": "cpu_offload", "offload_param": "cpu_offload_param"}[key]
    if section.get(legacy):
        return "cpu"
    return str(value.get("device", "none")) if isinstance(value, dict) else "none"


def _refuse_stage0_optimizer_offload(section: dict[str, Any], stage: int, device: str) -> None:
    """Optimizer offload asks for ZeRO: DeepSpeed 0.19.8 takes the section at stage 0, builds its CPU
    optimizer for it, and the first step then fails on an accelerator (the parameters are not on the CPU);
    ds says so before anything is built. `offload_param` at stages 0-2 only warns: nothing reads it there."""
    if stage != 0 or device == "none":
        return
    key = "cpu_offload" if section.get("cpu_offload") else "offload_optimizer.device"
    value = section["cpu_offload"] if key == "cpu_offload" else device
    raise DeepSpeedConfigError(
        f"zero_optimization.{key}={value!r}: optimizer offload needs ZeRO stage 1, 2 or 3, but "
        "zero_optimization.stage is 0 (DeepSpeed builds its CPU optimizer for it and fails at the first step "
        "on an accelerator); set zero_optimization.stage or remove the offload_optimizer section"
    )


def resolve_zero(value: dict[str, Any] | bool | None) -> ZeroSettings:
    """Validate `zero_optimization` and reduce it to `ZeroSettings`.

    `offload_param` at stage 0 warns that it has no effect and resolves to device "none"; `offload_optimizer`
    at stage 0 is refused.

    Raises:
        DeepSpeedConfigError: a bad stage, optimizer offload at stage 0, anything ds-zero's model refuses, or
            a `zenflow` section ds cannot run (`_zenflow_checks`), or one without ds-zero installed.
            Stage >= 1 without ds-zero installed is reported through `ZeroSettings.unavailable`.
    """
    if value is None:
        return ZeroSettings()
    if isinstance(value, bool):
        warnings.warn(
            f'"zero_optimization": {str(value).lower()} is deprecated; write {{"stage": {int(value)}}}',
            ConfigDeprecationWarning,
            stacklevel=3,
        )
        value = {"stage": int(value)}
    stage = _stage_of(value)
    devices = {key: _offload_device(value, key) for key in ("offload_optimizer", "offload_param")}
    _refuse_stage0_optimizer_offload(value, stage, devices["offload_optimizer"])
    try:
        ds_zero = require("ds_zero", extra="zero", feature=f"ZeRO stage {stage}")
    except ImportError as err:
        if value.get("zenflow") is not None:
            raise DeepSpeedConfigError(ZENFLOW_NEEDS_ZERO) from None
        if stage > 0:
            return ZeroSettings(
                stage=stage,
                offload_optimizer_device=devices["offload_optimizer"],
                offload_param_device=devices["offload_param"],
                unavailable=f"zero_optimization.stage={stage}: {err}",
            )
        extra = sorted(set(value) - {"stage"})
        if extra:
            logger.warning(
                "zero_optimization keys %s have no effect at stage 0 and are not validated without "
                "ds-zero (pip install 'ds-engine[zero]')",
                extra,
            )
        return ZeroSettings()
    try:
        cfg = validate_section(ds_zero.ZeroConfig, value, path="zero_optimization")
    except ConfigError as err:
        raise DeepSpeedConfigError(str(err).replace("Value error, ", "")) from None
    check_zenflow(cfg)
    warn_ignored(cfg, path="zero_optimization")
    # `offload_param` below stage 3 has no effect (ds-zero's model warned once, naming it), as in DeepSpeed:
    # nothing downstream offloads or swaps parameters for it.
    return ZeroSettings(
        stage=cfg.stage,
        offload_optimizer_device=cfg.offload_optimizer_device,
        offload_param_device=cfg.offload_param_device if cfg.stage > 0 else "none",
        reduce_bucket_size=cfg.reduce_bucket_size,
        load_from_fp32_weights=cfg.load_from_fp32_weights,
        gather_16bit_weights_on_model_save=cfg.gather_16bit_weights_on_model_save,
        zero_config=cfg,
    )
