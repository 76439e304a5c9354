"""The precision half of an optimizer step, in one order for every caller: unscale, check, scale update, norm, clip.

[Note: one order] Stage 0's fp16/bf16 wrapper, ZeRO 1/2, ZeRO 3 and the fp32 stepper all finish their
reduced gradients with `finish_step`, so they agree on what an overflow is and what it does:

1. unscale by 1/loss_scale, fused with the inf/nan check (`unscale_and_check_`; one pass);
2. the overflow flag (plus any skip the caller was told about) is agreed across the caller's ranks;
3. the loss scaler records the step (overflowed or not);
4. the global gradient norm, where asked for (clipping, `compute_grad_norm`), over the caller's layout
   (`global_grad_norm`'s note: where the norm lives);
5. on a clean step, the clip coefficient is applied to the gradients in place.

The flag and the partial norm share one all-reduce, and the step reads one small tensor back to the
host (the skip is a Python decision), so a step costs at most one collective (two with a
model-parallel group) and one sync; none when nothing is checked, normed or shared. When the norm is
computed anyway over every gradient and no unscale pass is needed (scale 1, e.g. bf16), a non-finite
norm is the overflow signal and the separate check pass is saved.

[Note: model parallelism] With tensor parallelism each rank of a model-parallel group holds a
different shard of the cut parameters, and a copy of the rest (layer norms, row-parallel biases). The
true norm counts every shard once and every replicated parameter once: each rank adds its cut
gradients' terms, only the group's first rank adds the replicated ones, and the terms are summed over
the group; the overflow flag is OR-ed there too, so every shard of the model skips the same step. This
is the same small tensor sent once more, over `model_parallel_group`, after the data-parallel reduction.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence

import torch
from torch.distributed import ProcessGroup

import ds_comm
from ds_ops.precision._grad_norm import local_norm_term
from ds_ops.precision._loss_scaler import LossScaler
from ds_ops.precision._overflow import unscale_and_check_

logger = logging.getLogger(__name__)

__all__ = ["GradStats", "StepOutcome", "finish_step", "grad_norm_groups"]

_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class StepOutcome:
    """What `finish_step` decided.

    Attributes:
        applied: False when the step must be skipped (an inf/nan gradient on any rank, or the caller's
            `skip`); the gradients are then unscaled but not clipped, and the caller must not update.
        grad_norm: the unscaled global gradient norm before clipping; None when it was not computed.
        clip_coef: the factor the gradients were multiplied by for clipping (1.0: not clipped).
    """

    applied: bool
    grad_norm: float | None
    clip_coef: float = 1.0
    unscale: float = 1.0
    """With `stats` (gradients not in memory): the factor the caller must still multiply the gradients by,
    before `clip_coef`, as it reads them (1/loss_scale); 1.0 when `finish_step` unscaled them in place."""

    def apply_(self, grad: torch.Tensor) -> torch.Tensor:
        """Multiply a gradient read after the decision by the pending factors, in `finish_step`'s order."""
        if self.unscale != 1.0:
            grad.mul_(self.unscale)
        if self.clip_coef != 1.0:
            grad.mul_(self.clip_coef)
        return grad

    @property
    def overflow(self) -> bool:
        return not self.applied


@dataclasses.dataclass(frozen=True)
class GradStats:
    """What `finish_step` needs of gradients the caller keeps out of memory (ZeRO-Infinity swaps them to
    NVMe): measured on the still loss-scaled gradients as they were last written.

    Attributes:
        norm_term: this rank's sum of |g|^p (the max |g| for p = inf), as `local_norm_term` computes it.
        nonfinite: whether any element is inf or nan.
    """

    norm_term: float
    nonfinite: bool


def finish_step(
    grads: Sequence[torch.Tensor | None],
    *,
    scaler: LossScaler | None,
    clip: float = 0.0,
    check_overflow: bool = True,
    compute_norm: bool = False,
    group: ProcessGroup | None = None,
    partitioned: bool = False,
    comm_device: torch.device | None = None,
    skip: torch.Tensor | None = None,
    norm_type: float = 2.0,
    model_parallel_group: ProcessGroup | None = None,
    model_parallel_grads: Sequence[torch.Tensor | None] | None = None,
    stats: GradStats | None = None,
) -> StepOutcome:
    """Unscale, check, update the loss scale, take the norm and clip `grads` in place (see the module note).

    Every rank of `group` must call it when `partitioned` (it issues one all-reduce there), and every
    rank of `model_parallel_group` when that is given (one more all-reduce there).

    Args:
        grads: this rank's reduced, still loss-scaled gradients (None and empty entries are ignored).
        scaler: the loss scaler (None: no scaling, nothing to update).
        clip: clip to this global norm (0: off).
        check_overflow: skip on an inf/nan gradient (fp16 always; `bf16.check_grad_overflow`). Off,
            a bad gradient is applied as it is (and not clipped: its norm is not finite).
        compute_norm: compute the norm even when not clipping (`compute_grad_norm`, reporting).
        group: the ranks that hold the gradient together and must agree on the skip.
        partitioned: True when each rank of `group` holds a disjoint part (ZeRO): the overflow flag and
            the partial norm are all-reduced over `group`. False when every rank holds the same full
            gradient (after a data-parallel all-reduce): the decision already agrees, nothing is sent.
        comm_device: where the all-reduce runs (the accelerator for nccl, even for host gradients).
        skip: a 1-element flag from the caller, already agreed across the ranks that must skip together
            (the pipeline's stages); non-zero skips the step as an overflow would.
        norm_type: p of the norm (2 for DeepSpeed's clipping).
        model_parallel_group: the ranks that hold other pieces of the same model (tensor-parallel shards;
            see the module note): the flag and the norm are also combined over it. None: no model
            parallelism.
        model_parallel_grads: with `model_parallel_group`, views into `grads` of the parameters cut across
            it; the rest of `grads` is replicated on the group and counted in the norm by its first rank
            only. None: all of `grads` is cut (counted on every rank).
        stats: instead of `grads` (pass none), the measured norm term and inf/nan flag of gradients the
            caller holds elsewhere; nothing is multiplied in place, and the outcome's `unscale` and
            `clip_coef` are for the caller to apply (`StepOutcome.apply_`) as it reads them (no model
            parallelism with it).

    Returns:
        The decision, and the norm when computed.

    Raises:
        ValueError: a negative `clip`, or a dynamic scaler without `check_overflow` (it adapts to overflows).
        LossScaleAtMinimumError: from a dynamic scaler that overflows at its minimum scale.
    """
    if clip < 0:
        raise ValueError(f"clip (gradient_clipping) must be >= 0, got {clip}")
    if scaler is not None and scaler.dynamic and not check_overflow:
        raise ValueError("a dynamic loss scaler needs check_overflow=True: it lowers the scale on overflows")
    tensors = [g for g in grads if g is not None and g.numel() > 0]
    if stats is not None and (tensors or model_parallel_group is not None):
        raise ValueError("finish_step: pass the gradients or their stats, not both (and no model-parallel group)")
    counted = _counted(tensors, model_parallel_group, model_parallel_grads)
    scale = scaler.loss_scale if scaler is not None else 1.0
    need_norm = compute_norm or clip > 0
    p = float(norm_type)
    # 1. unscale (+ check, fused). A norm that leaves the replicated gradients out (on all but one rank)
    # cannot stand in for the check; every rank of the group must send the same parts, so all check.
    partial = model_parallel_group is not None and model_parallel_grads is not None
    flag: torch.Tensor | None = None
    pending = 1.0
    if stats is not None:
        pending = 1.0 / scale
        if check_overflow:
            flag = torch.tensor([float(stats.nonfinite)])
    elif check_overflow and (scale != 1.0 or not need_norm or partial):
        flag = unscale_and_check_(tensors, 1.0 / scale)
    elif scale != 1.0 and tensors:
        torch._foreach_mul_(tensors, 1.0 / scale)
    if skip is not None:
        skip = skip.reshape(1).float()
        flag = skip if flag is None else torch.maximum(flag, skip.to(flag.device))
    # 2 + 4. one all-reduce for the flag and the partial norm, one read back
    parts = []
    if need_norm and stats is not None:  # the unscaled term: |g / scale|^p = |g|^p / scale^p
        factor = pending if math.isinf(p) else pending**p
        parts.append(torch.tensor([stats.norm_term * factor], dtype=torch.float32))
    elif need_norm:
        parts.append(local_norm_term(counted, p))
    if flag is not None:
        parts.append(flag)
    values = _agree(
        parts,
        group=group,
        partitioned=partitioned,
        comm_device=comm_device if comm_device is not None or not tensors else tensors[0].device,
        max_op=math.isinf(p),
        model_parallel_group=model_parallel_group,
    )
    norm = None
    overflow = False
    if need_norm:
        term = values.pop(0)
        norm = term if math.isinf(p) else term ** (1.0 / p)
        overflow = check_overflow and not math.isfinite(norm)
    if flag is not None:
        overflow = overflow or values.pop(0) > 0
    # 3. the scaler sees every step, skipped or not
    if scaler is not None:
        scaler.update_scale(overflow)
    if overflow:
        logger.info(
            "step skipped: %s (loss scale %s)",
            "gradient overflow" if skip is None else "gradient overflow or the caller's skip",
            scale,
        )
        return StepOutcome(applied=False, grad_norm=norm, unscale=pending)
    # 5. clip
    coef = 1.0
    if clip > 0 and norm is not None and math.isfinite(norm):
        coef = min(clip / (norm + _EPS), 1.0)
        if coef < 1.0 and tensors:
            torch._foreach_mul_(tensors, coef)
    return StepOutcome(applied=True, grad_norm=norm, clip_coef=coef, unscale=pending)


def grad_norm_groups(
    groups: Sequence[Sequence[torch.Tensor | None]] | None = None,
    *,
    group: ProcessGroup | None = None,
    partitioned: bool = True,
    comm_device: torch.device | None = None,
    norm_type: float = 2.0,
    model_parallel_group: ProcessGroup | None = None,
    model_parallel_grads: Sequence[Sequence[torch.Tensor | None]] | None = None,
    stats: Sequence[GradStats] | None = None,
) -> list[torch.Tensor]:
    """The `norm_type` norm of each entry of `groups`, measured as `finish_step` measures the whole gradient.

    Each entry (one optimizer param group's gradients, say) is combined over the same layout
    `finish_step` uses (`partitioned` over `group`, the model-parallel rule of the module note), so the
    norm of the returned norms is the global norm `finish_step` would take. Nothing is unscaled or
    checked: the gradients are measured as they are held (loss-scaled, under fp16). Every rank of
    `group` must call it when `partitioned`, and every rank of `model_parallel_group` when given: one
    all-reduce for all entries on each. No host sync.

    Args:
        groups: per entry, this rank's gradient tensors (None and empty ones are skipped).
        group, partitioned, comm_device, norm_type, model_parallel_group: as for `finish_step`.
        model_parallel_grads: with `model_parallel_group`, per entry, the views of its cut parameters.
        stats: instead of `groups` (pass None), per entry, the measured term of gradients held elsewhere.

    Returns:
        One 0-dim fp32 tensor per entry, on `comm_device` (default: where the tensors are); inf or nan
        where an entry holds an overflowed gradient.

    Raises:
        ValueError: both or neither of `groups` and `stats`, or a `model_parallel_grads` of another length.
    """
    if (groups is None) == (stats is None):
        raise ValueError("grad_norm_groups: pass the gradients (groups) or their stats, exactly one of them")
    p = float(norm_type)
    terms: list[torch.Tensor] = []
    if stats is not None:
        terms = [torch.tensor([s.norm_term], dtype=torch.float32) for s in stats]
    else:
        assert groups is not None
        if model_parallel_grads is not None and len(model_parallel_grads) != len(groups):
            raise ValueError(
                f"grad_norm_groups: model_parallel_grads has {len(model_parallel_grads)} entries for "
                f"{len(groups)} groups"
            )
        for i, grads in enumerate(groups):
            tensors = [g for g in grads if g is not None and g.numel() > 0]
            cut = list(model_parallel_grads[i]) if model_parallel_grads is not None else None
            terms.append(local_norm_term(_counted(tensors, model_parallel_group, cut), p))
    if not terms:
        return []
    if comm_device is None:
        comm_device = next((t.device for grads in groups or () for t in grads if t is not None), None)
    packed = _agree_packed(
        terms,
        group=group,
        partitioned=partitioned,
        comm_device=comm_device,
        max_op=math.isinf(p),
        model_parallel_group=model_parallel_group,
    )
    norms = packed if math.isinf(p) else packed.pow(1.0 / p)
    return list(norms.unbind())


def _counted(
    tensors: list[torch.Tensor],
    model_parallel_group: ProcessGroup | None,
    model_parallel_grads: Sequence[torch.Tensor | None] | None,
) -> list[torch.Tensor]:
    """What this rank adds to the norm: everything, except the replicated part off the group's first rank."""
    if model_parallel_group is None or model_parallel_grads is None or not ds_comm.is_initialized():
        return tensors
    if ds_comm.get_world_size(model_parallel_group) == 1 or ds_comm.get_rank(model_parallel_group) == 0:
        return tensors
    return [g for g in model_parallel_grads if g is not None and g.numel() > 0]


def _agree(
    parts: list[torch.Tensor],
    *,
    group: ProcessGroup | None,
    partitioned: bool,
    comm_device: torch.device | None,
    max_op: bool,
    model_parallel_group: ProcessGroup | None = None,
) -> list[float]:
    """The parts (1-element tensors) summed (or maxed) over `group` when partitioned, then over
    `model_parallel_group` when given, as Python floats."""
    if not parts:
        return []
    packed = _agree_packed(
        parts,
        group=group,
        partitioned=partitioned,
        comm_device=comm_device,
        max_op=max_op,
        model_parallel_group=model_parallel_group,
    )
    return packed.tolist()  # the step's one host sync


def _agree_packed(
    parts: list[torch.Tensor],
    *,
    group: ProcessGroup | None,
    partitioned: bool,
    comm_device: torch.device | None,
    max_op: bool,
    model_parallel_group: ProcessGroup | None = None,
) -> torch.Tensor:
    """`_agree` without the read back: the combined parts as one fp32 tensor on `comm_device`."""
    device = comm_device if comm_device is not None else parts[0].device
    packed = torch.cat([t.reshape(1).float().to(device) for t in parts])
    # Flags add up as well as they max (any rank's 1 makes the sum > 0), so one SUM serves both.
    op = ds_comm.ReduceOp.MAX if max_op else ds_comm.ReduceOp.SUM
    if partitioned and ds_comm.is_initialized() and ds_comm.get_world_size(group) > 1:
        ds_comm.all_reduce(packed, op=op, group=group)
    mp = model_parallel_group
    if mp is not None and ds_comm.is_initialized() and ds_comm.get_world_size(mp) > 1:
        ds_comm.all_reduce(packed, op=op, group=model_parallel_group)
    return packed
