"""Muon's update: Nesterov momentum, then the nearest (semi-)orthogonal matrix by a Newton–Schulz iteration.

Why Newton–Schulz: an SVD per weight matrix per step is too slow; five steps of a quintic
polynomial iteration push every singular value of the normalised matrix towards one using only
matrix products. The coefficients (3.4445, -4.7750, 2.0315) are Keller Jordan's, chosen for a steep
slope at zero rather than exact convergence, so the result is `U S' V^T` with `S'` roughly in
[0.7, 1.2]; DeepSpeed and torch use the same ones.

The iteration runs in fp32 here (fp64 for fp64 input): the point of ds's Muon is to be checkable against a plain
reference to fp32 precision on any device. DeepSpeed 0.19.8 runs it in fp16 ("gram") or bf16
("standard") on accelerators; its "gram" variant re-associates the same polynomial around the
small Gram matrix to save FLOPs, so both `ns_method` values compute the same function here.
"""

from __future__ import annotations

import math

import torch

__all__ = ["NS_COEFFICIENTS", "NS_METHODS", "muon_update", "newton_schulz_orthogonalize"]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_METHODS = ("gram", "standard")


def newton_schulz_orthogonalize(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Approximately `U V^T` for `g = U S V^T` (the last two dims are the matrix; leading dims batch).

    Args:
        g: a matrix (or a batch of matrices), any float dtype; computed in fp32 (or fp64 for fp64
            input), returned in `g`'s dtype.
        steps: Newton–Schulz iterations (5 is Muon's default).
        eps: added to the Frobenius norm before dividing, so a zero matrix stays zero.

    Raises:
        ValueError: `g` has fewer than two dims, or `steps` < 0.
    """
    if g.ndim < 2:
        raise ValueError(f"Newton-Schulz orthogonalization needs a matrix, got shape {tuple(g.shape)}")
    if steps < 0:
        raise ValueError(f"ns_steps must be >= 0, got {steps}")
    a, b, c = NS_COEFFICIENTS
    x = g.to(torch.promote_types(g.dtype, torch.float32))
    tall = g.size(-2) > g.size(-1)
    if tall:  # iterate on the wide orientation: the Gram matrix x @ x^T is then the smaller one
        x = x.mT
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + eps)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.mT
        poly = b * gram + c * (gram @ gram)
        x = a * x + poly @ x
    if tall:
        x = x.mT
    return x.to(g.dtype)


def muon_update(
    grad: torch.Tensor,
    momentum: torch.Tensor,
    *,
    beta: float = 0.95,
    ns_steps: int = 5,
    nesterov: bool = True,
    num_heads: int | None = None,
    ns_method: str = "gram",
    is_expert_group: bool = False,
) -> torch.Tensor:
    """The Muon step direction for one weight matrix; advances `momentum` in place.

    `momentum <- lerp(momentum, grad, 1 - beta)`; the direction is `lerp(grad, momentum, beta)`
    (Nesterov) or `momentum`, orthogonalized, times `sqrt(max(1, rows / cols))` so tall matrices get
    the same per-element RMS as wide ones. A 4-D (convolution) gradient is orthogonalized as
    `[out_channels, -1]` and a 3-D one as a batch of matrices; the scale reads the last two dims of
    `grad` either way, as DeepSpeed does.

    With `num_heads` (per-head Muon, an attention projection `[num_heads * head_dim, in_features]`)
    the direction is orthogonalized as a batch of `num_heads` blocks of `head_dim` rows, each scaled
    by `sqrt(max(1, head_dim / in_features))`: every head gets its own orthogonal update instead of
    sharing one with the other heads.

    A non-finite gradient leaves `momentum` untouched and is returned as is, so the caller's
    overflow check still sees it and one skipped step does not poison the momentum.

    Args:
        grad: the (averaged, unscaled) gradient, at least 2-D; not modified.
        momentum: the momentum buffer, same shape as `grad`.
        beta: momentum coefficient.
        ns_steps: Newton–Schulz iterations.
        nesterov: use the Nesterov look-ahead.
        num_heads: orthogonalize per head (rows split into this many equal blocks); None: the whole matrix.
        ns_method: DeepSpeed's choice of iteration, "gram" or "standard"; both compute the same function
            here (see the module docstring).
        is_expert_group: DeepSpeed's flag for a stacked `[experts, rows, cols]` expert gradient; a 3-D
            gradient is orthogonalized per expert whatever its value, so it changes nothing here.

    Raises:
        ValueError: `ns_method` is neither "gram" nor "standard", `grad` is not a matrix, the shapes
            differ, or (`num_heads`) `grad` is not 2-D or its rows do not split into `num_heads` equal blocks.
    """
    if ns_method not in NS_METHODS:
        raise ValueError(f"ns_method must be one of {NS_METHODS}, got {ns_method!r}")
    del is_expert_group  # accepted for DeepSpeed's signature; a 3-D gradient is a batch of matrices anyway
    if grad.ndim < 2:
        raise ValueError(f"Muon updates matrices (>= 2-D); got a gradient of shape {tuple(grad.shape)}")
    if momentum.shape != grad.shape:
        raise ValueError(f"momentum shape {tuple(momentum.shape)} != gradient shape {tuple(grad.shape)}")
    if num_heads is not None:
        _check_heads(grad, num_heads)
    finite = torch.isfinite(grad).all()
    momentum.copy_(torch.where(finite, momentum.lerp(grad.to(momentum.dtype), 1.0 - beta), momentum))
    direction = grad.to(momentum.dtype).lerp(momentum, beta) if nesterov else momentum
    if num_heads is not None:
        rows, cols = grad.size(0) // num_heads, grad.size(1)
        heads = direction.reshape(num_heads, rows, cols)
        update = newton_schulz_orthogonalize(heads, ns_steps).reshape(grad.shape)
    else:
        matrix = direction.reshape(direction.size(0), -1) if direction.ndim == 4 else direction
        update = newton_schulz_orthogonalize(matrix, ns_steps).view(grad.shape)
        rows, cols = grad.size(-2), grad.size(-1)
    if rows > cols:
        update = update * math.sqrt(rows / cols)
    return torch.where(finite, update, grad.to(update.dtype)).to(grad.dtype)


def _check_heads(grad: torch.Tensor, num_heads: int) -> None:
    if grad.ndim != 2:
        raise ValueError(f"per-head Muon needs a 2-D attention projection, got a gradient of shape {tuple(grad.shape)}")
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1 or grad.size(0) % num_heads:
        raise ValueError(
            f"per-head Muon: the {grad.size(0)} rows of a {tuple(grad.shape)} matrix do not split into "
            f"num_heads={num_heads!r} equal heads"
        )
