"""Causal-LM cross entropy over given logits without fp32 `[rows, vocab]` temporaries.

`F.cross_entropy(logits.float(), ...)` on bf16 logits makes an fp32 copy, saves an fp32 log-softmax and
allocates two more fp32 `[rows, vocab]` tensors in backward; with a large vocabulary and a long sequence
these are the step's memory peak. Here forward keeps the logits as given plus one log-sum-exp per row,
and both passes work one block of rows at a time (a block of about 2**26 fp32 elements), writing the
gradient straight in the logits' dtype.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

__all__ = [
    "BACKENDS",
    "ChunkedCausalLMLoss",
    "chunked_cross_entropy",
    "install_chunked_causal_lm_loss",
    "triton_backend_available",
]

BACKENDS = ("auto", "triton", "torch")
_BLOCK_ELEMENTS = 1 << 26


def triton_backend_available() -> bool:
    """ds computes this loss with PyTorch on every device: there is no Triton kernel."""
    return False


def _backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {BACKENDS}")
    if backend == "triton":
        raise RuntimeError('backend="triton": ds has no Triton cross-entropy kernel; use backend="torch" or "auto"')
    return "torch"


def _check_block_rows(block_rows: Any) -> int | None:
    if block_rows is None:
        return None
    try:
        rows = operator.index(block_rows)
    except TypeError as err:
        raise TypeError(f"block_rows={block_rows!r}: must be a positive integer or None") from err
    if rows <= 0:
        raise ValueError(f"block_rows={rows}: must be a positive integer or None")
    return rows


class _ChunkedCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, ignore_index: int, rows: int) -> torch.Tensor:
        stat = torch.promote_types(logits.dtype, torch.float32)
        valid = target != ignore_index
        safe = torch.where(valid, target, 0)
        lse = torch.empty(logits.shape[0], dtype=stat, device=logits.device)
        picked = torch.empty_like(lse)
        for lo in range(0, logits.shape[0], rows):
            block = logits[lo : lo + rows].to(stat)
            lse[lo : lo + rows] = torch.logsumexp(block, dim=-1)
            picked[lo : lo + rows] = block.gather(-1, safe[lo : lo + rows].unsqueeze(-1)).squeeze(-1)
        ctx.save_for_backward(logits, safe, valid, lse)
        ctx.rows = rows
        return torch.where(valid, lse - picked, 0.0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if torch.is_grad_enabled():
            raise RuntimeError("chunked_cross_entropy has no second derivative: backward(create_graph=True) is refused")
        logits, safe, valid, lse = ctx.saved_tensors
        scale = torch.where(valid, grad.to(lse.dtype), 0.0)
        out = torch.empty_like(logits)
        for lo in range(0, logits.shape[0], ctx.rows):
            hi = lo + ctx.rows
            p = torch.exp(logits[lo:hi].to(lse.dtype) - lse[lo:hi].unsqueeze(-1))
            p.scatter_add_(-1, safe[lo:hi].unsqueeze(-1), -torch.ones_like(p[:, :1]))
            out[lo:hi] = p.mul_(scale[lo:hi].unsqueeze(-1)).to(out.dtype)
        return out, None, None, None


def chunked_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    block_rows: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """`F.cross_entropy(logits.float(), target, ...)` for `[rows, vocab]` logits and `[rows]` long targets.

    "mean" divides by the non-ignored rows (NaN when all are ignored, as `cross_entropy`); `block_rows` sets
    the rows per block (default: about 2**26 elements a block).
    """
    rows = _check_block_rows(block_rows)
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(
            f"chunked_cross_entropy: expected [rows, vocab] logits and [rows] targets, got {tuple(logits.shape)} "
            f"and {tuple(target.shape)}"
        )
    if reduction not in ("none", "sum", "mean"):
        raise ValueError(f"reduction={reduction!r}: expected one of ('none', 'sum', 'mean')")
    if target.dtype != torch.long:
        raise RuntimeError(f"chunked_cross_entropy: targets must be torch.long class indices, got {target.dtype}")
    _backend(backend)
    target = target.to(logits.device).contiguous()
    bad = (target != ignore_index) & ((target < 0) | (target >= logits.shape[-1]))
    if bool(bad.any()):
        raise ValueError(f"Target is out of range for vocabulary size {logits.shape[-1]}")
    if rows is None:
        rows = max(1, _BLOCK_ELEMENTS // max(1, logits.shape[-1]))
    loss = _ChunkedCE.apply(logits.contiguous(), target, ignore_index, rows)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target != ignore_index).sum()


class ChunkedCausalLMLoss:
    """Hugging Face's `ForCausalLMLoss` (shift, ignore, normalize) computed by `chunked_cross_entropy`."""

    def __init__(self, block_rows: int | None = None, backend: str = "auto") -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}: expected one of {BACKENDS}")
        self.block_rows = _check_block_rows(block_rows)
        self.backend = backend

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int,
        num_items_in_batch: int | torch.Tensor | None = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if shift_labels is None:
            shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()
        reduction = "sum" if num_items_in_batch is not None else "mean"
        loss = chunked_cross_entropy(
            logits.reshape(-1, vocab_size),
            shift_labels.reshape(-1),
            ignore_index=ignore_index,
            reduction=reduction,
            block_rows=self.block_rows,
            backend=self.backend,
        )
        if num_items_in_batch is not None:
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss / num_items_in_batch
        return loss


def install_chunked_causal_lm_loss(
    model: Any, block_rows: int | None = None, backend: str = "auto"
) -> ChunkedCausalLMLoss:
    """Set a Hugging Face causal LM's `loss_function` to a `ChunkedCausalLMLoss` (only over `ForCausalLMLoss`)."""
    from transformers.loss.loss_utils import ForCausalLMLoss  # transformers is optional: only this needs it

    current = getattr(model, "loss_function", None)
    if current is not ForCausalLMLoss:
        raise ValueError(
            f"install_chunked_causal_lm_loss replaces only Hugging Face's ForCausalLMLoss; this model's "
            f"loss_function is {current!r}"
        )
    loss_fn = ChunkedCausalLMLoss(block_rows=block_rows, backend=backend)
    try:
        model.loss_function = loss_fn
    except (AttributeError, TypeError) as err:
        raise ValueError("install_chunked_causal_lm_loss: the model's loss_function cannot be set") from err
    if model.loss_function is not loss_fn:
        raise ValueError("install_chunked_causal_lm_loss: the model's loss_function ignores assignment")
    return loss_fn
