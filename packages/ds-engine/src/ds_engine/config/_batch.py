"""The batch triple: any two of train_batch_size, micro batch and accumulation steps give the third."""

from __future__ import annotations

import dataclasses

from ds_engine.config._errors import DeepSpeedConfigError

__all__ = ["BatchPlan", "resolve_batch"]

TBS, MBS, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """Resolved batch sizes and where each came from (for `ds-engine explain`)."""

    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    world_size: int
    sources: dict[str, str]
    """key -> "given", "default" or "derived: <formula with the numbers>"."""


def _exact(numerator: int, denominator: int, *, target: str, why: str) -> int:
    if numerator % denominator:
        raise DeepSpeedConfigError(
            f"{target}: {why} = {numerator} / {denominator} = {numerator / denominator:g} is not a whole number; "
            f"make {TBS} a multiple of {denominator}"
        )
    return numerator // denominator


def resolve_batch(tbs: int | None, mbs: int | None, gas: int | None, world_size: int) -> BatchPlan:
    """Fill in the missing member(s) of the batch triple with DeepSpeed's rules, exactly.

    `train_batch_size = micro x gas x world_size`. Given all three they must agree; given two the
    third is derived (and must come out whole); given only one of tbs/micro, gas is 1.

    Raises:
        DeepSpeedConfigError: none of tbs/micro given, a non-whole derived value, or a mismatch; each
            message states the numbers involved.
    """
    if world_size < 1:
        raise DeepSpeedConfigError(f"data-parallel world size must be >= 1, got {world_size}")
    ws = world_size
    src = {TBS: "given", MBS: "given", GAS: "given"}
    if tbs is None and mbs is None:
        raise DeepSpeedConfigError(
            f"{TBS} or {MBS} must be set (with {GAS} they define the batch: "
            f"{TBS} = {MBS} x {GAS} x data-parallel world size)"
        )
    if tbs is not None and mbs is not None and gas is not None:
        if tbs != mbs * gas * ws:
            raise DeepSpeedConfigError(
                f"{TBS} ({tbs}) must equal {MBS} ({mbs}) x {GAS} ({gas}) x data-parallel world size ({ws}) "
                f"= {mbs * gas * ws}"
            )
    elif tbs is not None and mbs is not None:
        gas = _exact(tbs, mbs * ws, target=GAS, why=f"{TBS} / ({MBS} x world size) = {tbs} / ({mbs} x {ws})")
        src[GAS] = f"derived: {TBS} / ({MBS} x world size) = {tbs} / ({mbs} x {ws})"
    elif tbs is not None and gas is not None:
        mbs = _exact(tbs, gas * ws, target=MBS, why=f"{TBS} / ({GAS} x world size) = {tbs} / ({gas} x {ws})")
        src[MBS] = f"derived: {TBS} / ({GAS} x world size) = {tbs} / ({gas} x {ws})"
    elif mbs is not None and gas is not None:
        tbs = mbs * gas * ws
        src[TBS] = f"derived: {MBS} x {GAS} x world size = {mbs} x {gas} x {ws}"
    elif tbs is not None:
        gas, src[GAS] = 1, "default"
        mbs = _exact(tbs, ws, target=MBS, why=f"{TBS} / world size = {tbs} / {ws}")
        src[MBS] = f"derived: {TBS} / world size = {tbs} / {ws}"
    else:
        assert mbs is not None
        gas, src[GAS] = 1, "default"
        tbs = mbs * ws
        src[TBS] = f"derived: {MBS} x world size = {mbs} x {ws}"
    return BatchPlan(tbs, mbs, gas, ws, src)
