"""Choosing, gathering and scattering the tokens a random-LTD layer runs on, in plain PyTorch (any device, any dtype).

`gpt_sample_tokens` / `bert_sample_tokens` draw, per layer and per sequence, `reserved_length` distinct
positions uniformly at random (`torch.multinomial` over equal weights, as DeepSpeed draws them) and sort
them, so kept tokens stay in sequence order. A decoder's causal mask over the kept tokens is then the
top-left `reserved x reserved` block of the full one; an encoder's padding mask is gathered at the kept
rows and columns, per layer.

`GatherTokens` returns the activations unchanged together with the kept tokens; `ScatterTokens` writes
a layer's output for the kept tokens back into the full activations. Their gradients are the exact
ones of the two index operations (a gather's gradient is added at its positions; positions a scatter
overwrote get no gradient from the overwritten value), so chained as the random-LTD layer chains them
they give the gradient DeepSpeed's CUDA kernels give: the layer's gradient at kept tokens, the
pass-through gradient elsewhere.

Indices are `[batch, kept]`; activations `[batch, seq, hidden]` (`batch_first`) or `[seq, batch, hidden]`.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "GatherTokens",
    "ScatterTokens",
    "bert_sample_tokens",
    "gather_tokens",
    "gpt_sample_tokens",
    "scatter_tokens",
]


def _sorted_sample(reserved_length: int, seq_length: int, batch_size: int, layers: int, device: Any) -> torch.Tensor:
    if not 0 < reserved_length <= seq_length:
        raise ValueError(f"reserved_length must be in 1..seq_length ({seq_length}), got {reserved_length}")
    weights = torch.ones((layers * batch_size, seq_length), device=device)
    picked = torch.multinomial(weights, reserved_length)
    picked = torch.sort(picked, dim=-1).values
    return picked.reshape(layers, batch_size, reserved_length).to(torch.int32)


def gpt_sample_tokens(
    reserved_length: int,
    seq_length: int,
    batch_size: int,
    layers: int = 1,
    device: Any = "cpu",
    attn_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kept positions `[layers, batch, reserved]` (int32, sorted) for a decoder, and its mask over them
    (`attn_mask[:, :, :reserved, :reserved]`, or None without a mask)."""
    indices = _sorted_sample(reserved_length, seq_length, batch_size, layers, device)
    mask = attn_mask[:, :, :reserved_length, :reserved_length] if attn_mask is not None else None
    return indices, mask


def bert_sample_tokens(
    reserved_length: int,
    seq_length: int,
    batch_size: int,
    layers: int = 1,
    device: Any = "cpu",
    attn_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Kept positions `[layers, batch, reserved]` (int32, sorted) for an encoder, and per layer its
    `[batch, heads, reserved, reserved]` mask: `attn_mask` (`[batch, heads, seq, seq]`) at the kept rows and
    columns."""
    if attn_mask is None:
        raise ValueError(
            "bert_sample_tokens needs the attention mask (an encoder's padding mask is gathered at the kept "
            "tokens); pass it under the name set in data_efficiency.data_routing.random_ltd.model_mask_name"
        )
    indices = _sorted_sample(reserved_length, seq_length, batch_size, layers, device)
    rows = torch.arange(batch_size, device=indices.device)[:, None, None]
    masks = []
    for layer_indices in indices.long():
        # advanced indices on dims 0, 2, 3 around a slice: the result is [batch, kept, kept, heads]
        picked = attn_mask[rows, :, layer_indices[:, :, None], layer_indices[:, None, :]]
        masks.append(picked.permute(0, 3, 1, 2).contiguous())
    return indices, masks


def _expanded(indices: torch.Tensor, hidden: int, batch_first: bool) -> tuple[int, torch.Tensor]:
    """(the sequence dim, the `[batch, kept]` indices laid out and expanded to gather along it)."""
    idx = indices.long()
    if not batch_first:
        idx = idx.t()
    return (1 if batch_first else 0), idx.unsqueeze(-1).expand(*idx.shape, hidden)


def gather_tokens(activations: torch.Tensor, indices: torch.Tensor, batch_first: bool) -> torch.Tensor:
    """The kept tokens: `[batch, kept, hidden]` (or `[kept, batch, hidden]`)."""
    dim, idx = _expanded(indices, activations.size(-1), batch_first)
    return torch.gather(activations, dim, idx)


def scatter_tokens(
    all_activations: torch.Tensor, layer_activations: torch.Tensor, indices: torch.Tensor, batch_first: bool
) -> torch.Tensor:
    """A copy of `all_activations` with the kept positions replaced by `layer_activations`."""
    dim, idx = _expanded(indices, all_activations.size(-1), batch_first)
    return all_activations.clone().scatter_(dim, idx, layer_activations.to(all_activations.dtype))


class GatherTokens(torch.autograd.Function):
    """`(activations, kept tokens) = GatherTokens.apply(activations, indices, batch_first)`."""

    @staticmethod
    def forward(ctx: Any, activations: torch.Tensor, sorted_indices: torch.Tensor, batch_first: bool) -> Any:
        ctx.save_for_backward(sorted_indices)
        ctx.batch_first = batch_first
        return activations, gather_tokens(activations, sorted_indices, batch_first)

    @staticmethod
    def backward(ctx: Any, a_gradients: torch.Tensor, g_gradients: torch.Tensor) -> Any:
        # autograd materializes an unused output's gradient as zeros, so both are tensors here
        (sorted_indices,) = ctx.saved_tensors
        dim, idx = _expanded(sorted_indices, a_gradients.size(-1), ctx.batch_first)
        grad = a_gradients.clone().scatter_add_(dim, idx, g_gradients.to(a_gradients.dtype))
        return grad, None, None


class ScatterTokens(torch.autograd.Function):
    """`out = ScatterTokens.apply(all_activations, layer_activations, indices, batch_first)`."""

    @staticmethod
    def forward(
        ctx: Any,
        all_activations: torch.Tensor,
        layer_activations: torch.Tensor,
        sorted_indices: torch.Tensor,
        batch_first: bool,
    ) -> torch.Tensor:
        ctx.save_for_backward(sorted_indices)
        ctx.batch_first = batch_first
        ctx.layer_dtype = layer_activations.dtype
        return scatter_tokens(all_activations, layer_activations, sorted_indices, batch_first)

    @staticmethod
    def backward(ctx: Any, out_gradients: torch.Tensor) -> Any:
        (sorted_indices,) = ctx.saved_tensors
        dim, idx = _expanded(sorted_indices, out_gradients.size(-1), ctx.batch_first)
        layer_grad = torch.gather(out_gradients, dim, idx).to(ctx.layer_dtype)
        all_grad = out_gradients.clone().scatter_(dim, idx, 0.0)
        return all_grad, layer_grad, None, None
