"""Cross entropy over vocabulary-sharded logits (tensor parallel) and sequence-sharded tokens (sequence parallel).

A vocabulary-parallel LM head leaves each tensor-parallel rank the logits of its vocabulary rows only.
Gathering `[tokens, vocab]` to every rank is the largest activation of a long-sequence model; instead the
softmax statistics are combined across the group: the global max (one MAX all-reduce), then the sum of
exponentials and the target's logit (one SUM all-reduce each). Backward needs no collective: every
tensor-parallel rank back-propagates the same loss, so each local logit's gradient is
`softmax - onehot` from the saved statistics.

Sequence-parallel ranks own different tokens; their losses are summed (or averaged over the valid tokens
of the whole sequence) across the sequence group, or gathered per token.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

import ds_comm
from ds_parallel.sequence._vocab_shard import check_targets, global_sp_sum, is_parallel, resolve_vocab_metadata

__all__ = [
    "VocabParallelCausalLMLoss",
    "VocabParallelCrossEntropyLoss",
    "configure_vocab_parallel_loss",
    "validate_vocab_parallel_loss",
    "vocab_parallel_cross_entropy",
    "vocab_sequence_parallel_cross_entropy",
]

logger = logging.getLogger(__name__)

_REDUCTIONS = ("none", "sum", "mean")
_BACKENDS = ("torch", "liger")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 at least (half-precision softmax statistics lose the small terms), fp64 kept."""
    return torch.promote_types(dtype, torch.float32)


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        tp_group: ProcessGroup | None,
        start: int,
        end: int,
        ignore_index: int,
    ) -> torch.Tensor:
        x = logits.to(_compute_dtype(logits.dtype))
        local = x.shape[-1]
        row_max = x.amax(dim=-1)
        if is_parallel(tp_group):
            ds_comm.all_reduce(row_max, op=ds_comm.ReduceOp.MAX, group=tp_group)
        exp = torch.exp(x - row_max.unsqueeze(-1))
        valid = target != ignore_index
        mine = valid & (target >= start) & (target < end)
        local_target = (target - start).clamp(0, local - 1)
        picked = x.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        stats = torch.stack([exp.sum(dim=-1), torch.where(mine, picked, torch.zeros_like(picked))])
        if is_parallel(tp_group):
            ds_comm.all_reduce(stats, group=tp_group)
        sum_exp, target_logit = stats[0], stats[1]
        loss = torch.log(sum_exp) + row_max - target_logit
        loss = torch.where(valid, loss, torch.zeros_like(loss))
        exp /= sum_exp.unsqueeze(-1)  # the local softmax, all that backward needs
        ctx.save_for_backward(exp, local_target, mine, valid)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        softmax, local_target, mine, valid = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, local_target.unsqueeze(-1), -mine.unsqueeze(-1).to(g.dtype))
        g *= (grad.to(g.dtype) * valid.to(g.dtype)).unsqueeze(-1)
        return g.to(ctx.logits_dtype), None, None, None, None, None


class _GatherSequenceLoss(torch.autograd.Function):
    """All-gather per-token losses along dim 0 over the sequence group.

    Backward either sums every rank's gradient for this rank's slice (`sum_gradients`: each rank
    back-propagates its own function of the whole sequence) or takes this rank's slice of the upstream
    gradient (every rank back-propagates the same replicated loss).
    """

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, sp_group: ProcessGroup, sum_gradients: bool) -> torch.Tensor:
        world = ds_comm.get_world_size(sp_group)
        ctx.group, ctx.sum_gradients = sp_group, sum_gradients
        ctx.rank, ctx.local = ds_comm.get_rank(sp_group), loss.shape[0]
        out = torch.empty((ctx.local * world, *loss.shape[1:]), dtype=loss.dtype, device=loss.device)
        ds_comm.all_gather_into_tensor(out, loss.contiguous(), group=sp_group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if not ctx.sum_gradients:
            return grad.narrow(0, ctx.rank * ctx.local, ctx.local).contiguous(), None, None
        total = grad.contiguous().clone()
        ds_comm.all_reduce(total, group=ctx.group)
        return total.narrow(0, ctx.rank * ctx.local, ctx.local).contiguous(), None, None


def _check_common(reduction: str, backend: str, gather_sequence_loss: bool) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction={reduction!r}: expected one of {_REDUCTIONS}")
    if backend not in _BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {_BACKENDS}")
    if gather_sequence_loss and reduction != "none":
        raise ValueError(f"gather_sequence_loss=True needs reduction='none', got reduction={reduction!r}")


def _warn_liger_once() -> None:
    if not getattr(_warn_liger_once, "done", False):
        _warn_liger_once.done = True  # type: ignore[attr-defined]
        logger.warning(
            "vocabulary-parallel cross entropy: backend='liger' has no Liger kernel here; using the PyTorch "
            "implementation (same values and gradients)"
        )


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    tp_group: ProcessGroup | None = None,
    sp_group: ProcessGroup | None = None,
    vocab_start_index: int | None = None,
    vocab_end_index: int | None = None,
    global_vocab_size: int | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    gather_sequence_loss: bool = False,
    backend: str = "torch",
) -> torch.Tensor:
    """Cross entropy of `target` under logits whose last (vocabulary) dim is sharded over `tp_group`.

    Args:
        vocab_parallel_logits: `[..., local_vocab]`, this rank's vocabulary columns.
        target: `[...]` token ids in the global vocabulary (`ignore_index` skips a position).
        tp_group: the ranks that share the vocabulary (`None`: the logits hold the whole vocabulary).
        sp_group: the ranks that share the sequence (`None`: no sequence parallelism).
        vocab_start_index, vocab_end_index: this rank's shard; inferred for equal shards when both are None.
        global_vocab_size: a layout already checked (with explicit bounds) to skip the check's collective.
        reduction: "none" (per token), "sum" or "mean" over the valid tokens of the whole sequence group.
        gather_sequence_loss: with "none", all-gather the per-token losses over `sp_group` (dim 0).
        backend: "torch"; "liger" is accepted and runs the same PyTorch implementation.
    """
    if vocab_parallel_logits.shape[:-1] != target.shape:
        raise ValueError(
            f"vocab_parallel_logits {tuple(vocab_parallel_logits.shape)} and target {tuple(target.shape)} must "
            f"agree in every dim but the last (vocabulary) one"
        )
    if vocab_parallel_logits.shape[-1] == 0 and not is_parallel(tp_group):
        raise ValueError("vocab_parallel_logits has an empty vocabulary dim")
    _check_common(reduction, backend, gather_sequence_loss)
    if (vocab_start_index is None) != (vocab_end_index is None):
        raise ValueError("vocab_start_index and vocab_end_index must be given together (or neither)")
    if global_vocab_size is not None:
        if vocab_start_index is None:
            raise ValueError("global_vocab_size needs explicit vocab_start_index and vocab_end_index")
    else:
        vocab_start_index, vocab_end_index, global_vocab_size = resolve_vocab_metadata(
            vocab_parallel_logits.shape[-1], vocab_start_index, vocab_end_index, tp_group, vocab_parallel_logits.device
        )
    assert vocab_end_index is not None
    target = target.to(torch.long)
    check_targets(target, ignore_index, global_vocab_size)
    if backend == "liger":
        _warn_liger_once()
    loss = _VocabParallelCE.apply(
        vocab_parallel_logits, target, tp_group, vocab_start_index, vocab_end_index, ignore_index
    )
    if reduction == "none":
        if gather_sequence_loss:
            if sp_group is None:
                raise ValueError("gather_sequence_loss=True needs sp_group (the sequence-parallel group)")
            loss = _GatherSequenceLoss.apply(loss, sp_group, True)
        return loss
    total = global_sp_sum(loss.sum(), sp_group)
    if reduction == "sum":
        return total
    count = (target != ignore_index).sum().to(loss.dtype)
    if is_parallel(sp_group):
        ds_comm.all_reduce(count, group=sp_group)
    return total / count.clamp_min(1)


def vocab_sequence_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    sp_group: ProcessGroup | None,
    tp_group: ProcessGroup | None = None,
    vocab_start_index: int | None = None,
    vocab_end_index: int | None = None,
    ignore_index: int = -100,
    reduction: str = "none",
    gather_sequence_loss: bool = True,
    backend: str = "torch",
) -> torch.Tensor:
    """Per-token losses of this rank's sequence slice, gathered over `sp_group` along dim 0 by default.

    The gathered loss is replicated on every sequence rank; backward hands each rank the gradient of its
    own slice.
    """
    _check_common(reduction, backend, gather_sequence_loss)
    if gather_sequence_loss and sp_group is None:
        raise ValueError("gather_sequence_loss=True needs sp_group (the sequence-parallel group)")
    loss = vocab_parallel_cross_entropy(
        vocab_parallel_logits,
        target,
        tp_group=tp_group,
        sp_group=sp_group,
        vocab_start_index=vocab_start_index,
        vocab_end_index=vocab_end_index,
        ignore_index=ignore_index,
        reduction=reduction,
        backend=backend,
    )
    if not gather_sequence_loss:
        return loss
    assert sp_group is not None
    return _GatherSequenceLoss.apply(loss, sp_group, False)


class VocabParallelCrossEntropyLoss(nn.Module):
    """`vocab_parallel_cross_entropy` as a module: `loss_fn(vocab_parallel_logits, target)`."""

    def __init__(
        self,
        tp_group: ProcessGroup | None = None,
        sp_group: ProcessGroup | None = None,
        vocab_start_index: int | None = None,
        vocab_end_index: int | None = None,
        ignore_index: int = -100,
        reduction: str = "mean",
        gather_sequence_loss: bool = False,
        backend: str = "torch",
    ) -> None:
        super().__init__()
        _check_common(reduction, backend, gather_sequence_loss)
        self.tp_group, self.sp_group = tp_group, sp_group
        self.vocab_start_index, self.vocab_end_index = vocab_start_index, vocab_end_index
        self.ignore_index, self.reduction = ignore_index, reduction
        self.gather_sequence_loss, self.backend = gather_sequence_loss, backend

    def forward(self, vocab_parallel_logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(
            vocab_parallel_logits,
            target,
            tp_group=self.tp_group,
            sp_group=self.sp_group,
            vocab_start_index=self.vocab_start_index,
            vocab_end_index=self.vocab_end_index,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            gather_sequence_loss=self.gather_sequence_loss,
            backend=self.backend,
        )


class VocabParallelCausalLMLoss:
    """A Hugging Face `loss_function` for a vocabulary-sharded (no-gather) LM head: shift, then vocab-parallel CE.

    One instance serves one shard: its first call checks the layout across `tp_group` and keeps the result;
    a later call with a different shard is refused (make one instance per shard). Leave `sp_group` None under
    ds's Ulysses engine, which weights the per-rank means by their token counts itself.
    """

    def __init__(
        self,
        tp_group: ProcessGroup | None = None,
        sp_group: ProcessGroup | None = None,
        vocab_start_index: int | None = None,
        vocab_end_index: int | None = None,
        ignore_index: int = -100,
        backend: str = "torch",
    ) -> None:
        if backend not in _BACKENDS:
            raise ValueError(f"backend={backend!r}: expected one of {_BACKENDS}")
        self.tp_group, self.sp_group = tp_group, sp_group
        self.vocab_start_index, self.vocab_end_index = vocab_start_index, vocab_end_index
        self.ignore_index, self.backend = ignore_index, backend
        self._key: tuple[Any, ...] | None = None
        self._global_vocab_size: int | None = None

    def _layout(self, local: int, device: torch.device) -> int:
        if self._key is None:
            start, end, total = resolve_vocab_metadata(
                local, self.vocab_start_index, self.vocab_end_index, self.tp_group, device
            )
            self.vocab_start_index, self.vocab_end_index, self._global_vocab_size = start, end, total
            self._key = (self.tp_group, device, local, start, end)
            return total
        if (self.tp_group, device, local, self.vocab_start_index, self.vocab_end_index) != self._key:
            raise RuntimeError(
                "VocabParallelCausalLMLoss: the vocabulary shard changed after the first call; create one "
                "instance per shard"
            )
        assert self._global_vocab_size is not None
        return self._global_vocab_size

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor | None = None,
        vocab_size: int | None = None,
        shift_labels: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if shift_labels is None:
            if labels is None:
                raise ValueError("VocabParallelCausalLMLoss needs labels or shift_labels")
            shift_labels = labels[..., 1:].contiguous()
            logits = logits[..., :-1, :].contiguous()
        total = self._layout(logits.shape[-1], logits.device)
        if vocab_size is not None and vocab_size != total:
            logger.warning(
                "vocabulary-parallel LM head holds %d entries but the caller passed vocab_size=%d; the head wins",
                total,
                vocab_size,
            )
        loss = vocab_parallel_cross_entropy(
            logits,
            shift_labels.contiguous(),
            tp_group=self.tp_group,
            sp_group=self.sp_group,
            vocab_start_index=self.vocab_start_index,
            vocab_end_index=self.vocab_end_index,
            global_vocab_size=total,
            ignore_index=self.ignore_index,
            reduction="sum" if num_items_in_batch is not None else "mean",
            backend=self.backend,
        )
        if num_items_in_batch is not None:
            loss = loss / torch.as_tensor(num_items_in_batch, device=loss.device, dtype=loss.dtype).clamp_min(1)
        return loss


def _install(model: nn.Module, loss_fn: Callable[..., torch.Tensor]) -> Any:
    """Set `model.loss_function = loss_fn`; return the previous one (refused where the hook cannot be set)."""
    if not hasattr(model, "loss_function"):
        raise ValueError(
            f"{type(model).__name__} has no loss_function hook: a vocabulary-parallel LM head that does not "
            f"gather its logits needs one; keep the gathered head (gather_output=True) for this model"
        )
    previous = model.loss_function
    registered = model._modules.pop("loss_function", None)
    try:
        model.loss_function = loss_fn
    except (AttributeError, TypeError) as err:
        if registered is not None:
            model._modules["loss_function"] = registered
        raise ValueError(
            f"cannot set {type(model).__name__}.loss_function for the vocabulary-parallel loss; keep the gathered "
            f"head (gather_output=True)"
        ) from err
    if model.loss_function is not loss_fn:
        model.loss_function = previous
        raise ValueError(
            f"{type(model).__name__}.loss_function ignores assignment; keep the gathered head (gather_output=True)"
        )
    return previous


def validate_vocab_parallel_loss(model: nn.Module) -> None:
    """Check that `model.loss_function` can be replaced (before any weight is sharded); leave it unchanged."""
    model.loss_function = _install(model, VocabParallelCausalLMLoss())


def configure_vocab_parallel_loss(
    model: nn.Module,
    vocab_parallel_head: Any,
    sp_group: ProcessGroup | None = None,
    ignore_index: int = -100,
    backend: str = "torch",
) -> nn.Module:
    """Install the vocabulary-parallel causal-LM loss for `vocab_parallel_head`'s shard on `model`.

    The head provides `mp_group`, `vocab_start_index` and `vocab_end_index`. The original loss stays reachable
    as `model._deepspeed_original_loss_function`.
    """
    loss_fn = VocabParallelCausalLMLoss(
        tp_group=vocab_parallel_head.mp_group,
        sp_group=sp_group,
        vocab_start_index=vocab_parallel_head.vocab_start_index,
        vocab_end_index=vocab_parallel_head.vocab_end_index,
        ignore_index=ignore_index,
        backend=backend,
    )
    previous = _install(model, loss_fn)
    if not hasattr(model, "_deepspeed_original_loss_function"):
        model._deepspeed_original_loss_function = previous
    return model
