"""sequence_tiled_compute equals the untiled computation: outputs, the tiled input's gradient and the parameters'
gradients, fp32 to 1e-6 (only the summation order differs), for even and uneven tiles and every reduction."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ds_parallel.ulysses_sp import sequence_tiled_compute

TOL = {"atol": 1e-6, "rtol": 1e-6}


class GatedMLP(nn.Module):
    def __init__(self, hidden: int = 8, inner: int = 24) -> None:
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(hidden, inner), nn.Linear(hidden, inner), nn.Linear(inner, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


def _mlp(x: torch.Tensor, scale: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """Position-local: the MLP of x times a per-position scale (a second tiled input, without a gradient)."""
    return module(x) * scale


def _tile_loss(x: torch.Tensor, scale: torch.Tensor, module: nn.Module) -> torch.Tensor:
    return (_mlp(x, scale, module) ** 2).sum()


def _grads(module: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return [x.grad.clone(), *(p.grad.clone() for p in module.parameters())]


def _inputs(seqlen: int, seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    return GatedMLP(), torch.randn(2, seqlen, 8), torch.rand(2, seqlen, 1) + 0.5


@pytest.mark.parametrize(("seqlen", "shards"), [(12, 4), (10, 4), (9, 4), (7, 7), (9, 1)])
@pytest.mark.parametrize("reduction", [None, "mean", "sum"])
def test_per_position_output_matches_untiled(seqlen: int, shards: int, reduction: str | None) -> None:
    module, x, scale = _inputs(seqlen)
    x_ref = x.clone().requires_grad_()
    want = _mlp(x_ref, scale, module)
    want = want if reduction is None else want.mean() if reduction == "mean" else want.sum()
    upstream = torch.randn_like(want)
    want.backward(upstream)
    ref_grads = _grads(module, x_ref)
    module.zero_grad()

    x_tiled = x.clone().requires_grad_()
    got = sequence_tiled_compute(
        _mlp, seqlen, shards, {"x": x_tiled, "scale": scale}, {"module": module}, "x",
        list(module.parameters()), output_unshard_dimension=1, output_reduction=reduction,
    )  # fmt: skip
    torch.testing.assert_close(got, want.detach(), **TOL)
    got.backward(upstream)
    for a, b in zip(_grads(module, x_tiled), ref_grads, strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_one_loss_per_tile_stacked_on_dim_0_and_averaged() -> None:
    """DeepSpeed's loss use: each tile returns a scalar; dim 0 stacks them, "mean" averages over the tiles."""
    seqlen, shards = 12, 3
    module, x, scale = _inputs(seqlen, seed=1)
    x_ref = x.clone().requires_grad_()
    want = torch.stack(
        [_tile_loss(t, s, module) for t, s in zip(x_ref.split(4, 1), scale.split(4, 1), strict=True)]
    ).mean()
    want.backward()
    ref_grads = _grads(module, x_ref)
    module.zero_grad()
    x_tiled = x.clone().requires_grad_()
    got = sequence_tiled_compute(
        _tile_loss, seqlen, shards, {"x": x_tiled, "scale": scale}, {"module": module}, "x",
        output_unshard_dimension=0, output_reduction="mean",
    )  # fmt: skip
    torch.testing.assert_close(got, want.detach(), **TOL)
    got.backward()
    for a, b in zip(_grads(module, x_tiled), ref_grads, strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_forward_keeps_no_graph_of_the_tiles() -> None:
    """Only the inputs are saved: the tiles' intermediates (the memory the tiling is for) are not."""
    module, x, scale = _inputs(16)
    x.requires_grad_()
    saved: list[torch.Size] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        sequence_tiled_compute(_mlp, 16, 4, {"x": x, "scale": scale}, {"module": module}, "x", output_reduction=None)
    assert sorted(saved) == sorted([x.shape, scale.shape])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"output_reduction": "max"}, "output_reduction must be None, 'mean' or 'sum', got 'max'"),
        ({"shards": 0}, r"shards must be an int in \[1, seqlen=6\], got 0"),
        ({"shards": 7}, r"shards must be an int in \[1, seqlen=6\], got 7"),
        ({"grad_requiring_tensor_key": "y"}, r"grad_requiring_tensor_key 'y' is not one of the tiled inputs \['x'\]"),
        ({"seqlen": 5, "shards": 2}, r"kwargs_to_shard\['x'\] has shape \(1, 6, 8\)"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs: dict, message: str) -> None:
    module = GatedMLP()
    args = {
        "fn": lambda x, module: module(x),
        "seqlen": 6,
        "shards": 2,
        "kwargs_to_shard": {"x": torch.randn(1, 6, 8)},
        "kwargs_to_pass": {"module": module},
        "grad_requiring_tensor_key": "x",
    }
    with pytest.raises(ValueError, match=message):
        sequence_tiled_compute(**{**args, **kwargs})
