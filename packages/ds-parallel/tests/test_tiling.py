"""TiledMLP and TiledFusedLogitsLoss equal the untiled computation (outputs, input and parameter grads,
fp32 to 1e-6) and keep only their input for backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ds_parallel.ulysses_sp import TiledFusedLogitsLoss, TiledMLP

TOL = {"atol": 1e-6, "rtol": 1e-6}


class GatedMLP(nn.Module):
    """Llama's MLP shape: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int = 16, inner: int = 48) -> None:
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(hidden, inner), nn.Linear(hidden, inner), nn.Linear(inner, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


def _mlp_fn(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x)


def _saved_bytes(fn) -> int:  # noqa: ANN001 - a closure
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return saved


@pytest.mark.parametrize("shards", [1, 3, 4])
def test_tiled_mlp_matches_untiled(shards: int) -> None:
    torch.manual_seed(0)
    mlp = GatedMLP()
    x = torch.randn(2, 10, 16)
    w = torch.randn(2, 10, 16)
    x_ref, x_tiled = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref = mlp(x_ref)
    (ref * w).sum().backward()
    ref_grads = [p.grad.clone() for p in mlp.parameters()]
    mlp.zero_grad()
    out = TiledMLP.apply(_mlp_fn, mlp, x_tiled, shards, list(mlp.parameters()))
    (out * w).sum().backward()
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(x_tiled.grad, x_ref.grad, **TOL)
    for got, want in zip((p.grad for p in mlp.parameters()), ref_grads, strict=True):
        torch.testing.assert_close(got, want, **TOL)


def test_tiled_mlp_saves_only_its_input() -> None:
    mlp = GatedMLP(hidden=16, inner=256)
    x = torch.randn(1, 64, 16, requires_grad=True)
    tiled = _saved_bytes(lambda: TiledMLP.apply(_mlp_fn, mlp, x, 8, None))
    full = _saved_bytes(lambda: mlp(x))
    assert tiled == x.numel() * 4
    assert full > 10 * tiled  # the untiled graph keeps [64, 256] intermediates


def _loss_fn(head: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = head(x)
    return nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1), ignore_index=-100, reduction="sum"
    )


@pytest.mark.parametrize("shards", [1, 4, 5])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_tiled_logits_loss_matches_untiled(shards: int, reduction: str) -> None:
    torch.manual_seed(0)
    head = nn.Linear(16, 50, bias=False)
    x = torch.randn(2, 10, 16)
    y = torch.randint(0, 50, (2, 10))
    y[0, -3:] = -100
    mask = y != -100
    x_ref, x_tiled = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref = nn.functional.cross_entropy(
        head(x_ref).reshape(-1, 50), y.reshape(-1), ignore_index=-100, reduction=reduction
    )
    ref.backward()
    ref_grad = head.weight.grad.clone()
    head.zero_grad()
    loss = TiledFusedLogitsLoss.apply(_loss_fn, head, x_tiled, y, mask, shards, None, reduction)
    loss.backward()
    torch.testing.assert_close(loss, ref, **TOL)
    torch.testing.assert_close(x_tiled.grad, x_ref.grad, **TOL)
    torch.testing.assert_close(head.weight.grad, ref_grad, **TOL)


def test_bad_arguments_are_named() -> None:
    mlp = GatedMLP()
    with pytest.raises(ValueError, match="TiledMLP: 11 shards for a sequence of 10"):
        TiledMLP.apply(_mlp_fn, mlp, torch.randn(1, 10, 16), 11, None)
    head = nn.Linear(16, 50)
    with pytest.raises(ValueError, match="output_reduction must be 'mean' or 'sum', got 'avg'"):
        TiledFusedLogitsLoss.apply(
            _loss_fn, head, torch.randn(1, 4, 16), torch.zeros(1, 4, dtype=torch.long), None, 2, None, "avg"
        )
    with pytest.raises(ValueError, match=r"labels of shape \(1, 3\) do not match"):
        TiledFusedLogitsLoss.apply(
            _loss_fn, head, torch.randn(1, 4, 16), torch.zeros(1, 3, dtype=torch.long), None, 2, None, "mean"
        )
