"""Rotary position embedding in the half-split ("rotate half") convention, and its backward.

`t * cos + rotate_half(t) * sin` on the first `rot_dim` channels (the rest pass through), where
`rotate_half([x1, x2]) = [-x2, x1]`. FPDT applies it per sequence chunk after the all-to-all and needs the
hand-written backward because it runs inside its own autograd function.
"""

from __future__ import annotations

import torch

__all__ = ["apply_rotary_pos_emb", "apply_rotary_pos_emb_backward"]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """`[x1, x2] -> [-x2, x1]` over the halves of the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate_half_backward(g: torch.Tensor) -> torch.Tensor:
    """The transpose of `_rotate_half`: `[g1, g2] -> [g2, -g1]`."""
    g1, g2 = g.chunk(2, dim=-1)
    return torch.cat((g2, -g1), dim=-1)


def apply_rotary_pos_emb(t: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first `freqs_cos.shape[-1]` channels of `t` (freqs broadcast against `t`)."""
    rot = freqs_cos.shape[-1]
    head, rest = t[..., :rot], t[..., rot:]
    out = head * freqs_cos + _rotate_half(head) * freqs_sin
    return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)


def apply_rotary_pos_emb_backward(
    grad_output: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor
) -> torch.Tensor:
    """The gradient of `apply_rotary_pos_emb` with respect to `t`, given the gradient of its output."""
    rot = freqs_cos.shape[-1]
    head, rest = grad_output[..., :rot], grad_output[..., rot:]
    grad = head * freqs_cos + _rotate_half_backward(head * freqs_sin)
    return grad if rest.shape[-1] == 0 else torch.cat((grad, rest), dim=-1)
