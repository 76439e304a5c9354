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


def _sum_loss(head: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(head(x).float(), y, ignore_index=-100, reduction="sum")


def _mean_loss(head: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """DeepSpeed's documented `fn`: the tile's mean cross-entropy."""
    return nn.functional.cross_entropy(head(x).float(), y)


def _masked_sum_loss(head: nn.Module, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    per_token = nn.functional.cross_entropy(head(x).float(), y, reduction="none")
    return (per_token * mask).sum()


def _check(fn, head: nn.Module, x: torch.Tensor, y: torch.Tensor, mask, shards: int, reduction: str, reference) -> None:  # noqa: ANN001
    x_ref, x_tiled = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref = reference(x_ref)
    ref.backward(torch.tensor(0.5))  # an upstream gradient other than 1 reaches x and the weights
    ref_grad = head.weight.grad.clone()
    head.zero_grad()
    loss = TiledFusedLogitsLoss.apply(fn, head, x_tiled, y, mask, shards, list(head.parameters()), reduction)
    loss.backward(torch.tensor(0.5))
    torch.testing.assert_close(loss, ref.detach(), **TOL)
    torch.testing.assert_close(x_tiled.grad, x_ref.grad, **TOL)
    torch.testing.assert_close(head.weight.grad, ref_grad, **TOL)


def _data(seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    return nn.Linear(16, 50, bias=False), torch.randn(2, 10, 16), torch.randint(0, 50, (2, 10))


@pytest.mark.parametrize("shards", [1, 4, 5, 7])
def test_tiled_sum_loss_is_the_untiled_sum(shards: int) -> None:
    """Tiles over batch x sequence (20 tokens: 4 tiles of 5; 7 asked -> torch.chunk gives 7 of 3, the last 2)."""
    head, x, y = _data()
    y[0, -3:] = -100

    def untiled(xr: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(head(xr).reshape(-1, 50), y.reshape(-1), ignore_index=-100, reduction="sum")

    _check(_sum_loss, head, x, y, None, shards, "sum", untiled)


@pytest.mark.parametrize("shards", [1, 2, 4, 5])
def test_tiled_mean_of_mean_losses_is_the_untiled_mean_when_tiles_are_equal(shards: int) -> None:
    head, x, y = _data(1)

    def untiled(xr: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(head(xr).reshape(-1, 50), y.reshape(-1))

    _check(_mean_loss, head, x, y, None, shards, "mean", untiled)


def test_uneven_tiles_average_the_tiles_losses() -> None:
    """20 tokens in 3 tiles (7, 7, 6): "mean" is the mean of the three tiles' losses, as DeepSpeed defines it."""
    head, x, y = _data(2)

    def per_tile_mean(xr: torch.Tensor) -> torch.Tensor:
        tiles = zip(xr.reshape(-1, 16).split(7), y.reshape(-1).split(7), strict=True)
        return torch.stack([nn.functional.cross_entropy(head(a), b) for a, b in tiles]).mean()

    _check(_mean_loss, head, x, y, None, 3, "mean", per_tile_mean)


def test_the_mask_is_tiled_and_passed_to_fn() -> None:
    head, x, y = _data(3)
    mask = torch.rand(2, 10) > 0.3

    def untiled(xr: torch.Tensor) -> torch.Tensor:
        per_token = nn.functional.cross_entropy(head(xr).reshape(-1, 50), y.reshape(-1), reduction="none")
        return (per_token * mask.reshape(-1)).sum()

    _check(_masked_sum_loss, head, x, y, mask, 4, "sum", untiled)


def test_bad_arguments_are_named() -> None:
    mlp = GatedMLP()
    with pytest.raises(ValueError, match="TiledMLP: 11 shards for a sequence of 10"):
        TiledMLP.apply(_mlp_fn, mlp, torch.randn(1, 10, 16), 11, None)
    head = nn.Linear(16, 50)
    with pytest.raises(ValueError, match="output_reduction must be 'mean' or 'sum', got 'avg'"):
        TiledFusedLogitsLoss.apply(
            _sum_loss, head, torch.randn(1, 4, 16), torch.zeros(1, 4, dtype=torch.long), None, 2, None, "avg"
        )
    with pytest.raises(ValueError, match=r"labels of shape \(1, 3\) do not match"):
        TiledFusedLogitsLoss.apply(
            _sum_loss, head, torch.randn(1, 4, 16), torch.zeros(1, 3, dtype=torch.long), None, 2, None, "mean"
        )
    with pytest.raises(ValueError, match=r"mask of shape \(1, 3\) must be \[batch, seq\] = \(1, 4\)"):
        TiledFusedLogitsLoss.apply(
            _sum_loss,
            head,
            torch.randn(1, 4, 16),
            torch.zeros(1, 4, dtype=torch.long),
            torch.ones(1, 3),
            2,
            None,
            "sum",
        )
