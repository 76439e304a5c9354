"""`TiledLinear` computes `nn.Linear` (forward and gradients) from DeepSpeed's tile layout; bad shapes are errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ds_zero import TiledLinear, TiledLinearReturnBias
from ds_zero._construct.tiling import uniform_bounds


@pytest.mark.parametrize(("in_splits", "out_splits"), [(1, 1), (3, 2), (10, 7)])
@pytest.mark.parametrize("bias", [True, False])
def test_equals_the_linear_it_copies(in_splits: int, out_splits: int, bias: bool) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(10, 7, bias=bias)
    tiled = TiledLinear(10, 7, bias=bias, in_splits=in_splits, out_splits=out_splits, init_linear=linear)
    x = torch.randn(2, 5, 10, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    torch.testing.assert_close(tiled(x), linear(x_ref), rtol=0, atol=1e-6)
    tiled(x).square().sum().backward()
    linear(x_ref).square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=1e-5)
    rows = [torch.cat([t.weight.grad for t in row], dim=1) for row in tiled.linears]
    torch.testing.assert_close(torch.cat(rows, dim=0), linear.weight.grad, rtol=0, atol=1e-5)
    if bias:
        torch.testing.assert_close(torch.cat([row[-1].bias.grad for row in tiled.linears]), linear.bias.grad)


def test_layout_is_deepspeeds() -> None:
    # observed on DeepSpeed 0.19.8: TiledLinear(10, 7, in_splits=3, out_splits=2)
    tiled = TiledLinear(10, 7, in_splits=3, out_splits=2)
    assert tiled.in_parts == [0, 4, 7, 10] and tiled.out_parts == [0, 4, 7]
    shapes = [tuple(t.weight.shape) for row in tiled.linears for t in row]
    assert shapes == [(4, 4), (4, 3), (4, 3), (3, 4), (3, 3), (3, 3)]
    assert list(tiled.state_dict()) == [
        "linears.0.0.weight",
        "linears.0.1.weight",
        "linears.0.2.weight",
        "linears.0.2.bias",
        "linears.1.0.weight",
        "linears.1.1.weight",
        "linears.1.2.weight",
        "linears.1.2.bias",
    ]
    assert uniform_bounds(2, 4) == [0, 1, 2, 2, 2]


def test_already_split_input_and_separate_outputs() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(6, 4)
    tiled = TiledLinear(6, 4, in_splits=2, out_splits=2, input_is_already_split=True, combine_out_splits=False)
    tiled.copy_params_from(linear)
    x = torch.randn(3, 6)
    out = tiled([x[:, :3], x[:, 3:]])
    assert isinstance(out, list) and len(out) == 2
    torch.testing.assert_close(torch.cat(out, dim=-1), linear(x))
    with pytest.raises(ValueError, match="expected in_splits=2"):
        tiled([x])


class _ReturnBias(nn.Linear):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:  # type: ignore[override]
        return nn.functional.linear(x, self.weight), self.bias


def test_return_bias_variant_concatenates_the_biases() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(6, 4)
    tiled = TiledLinearReturnBias(6, 4, in_splits=2, out_splits=2, linear_cls=_ReturnBias, init_linear=linear)
    out, bias = tiled(torch.ones(1, 6))
    torch.testing.assert_close(out + bias, linear(torch.ones(1, 6)))


def test_bad_arguments() -> None:
    with pytest.raises(RuntimeError, match="in_splits=0"):
        TiledLinear(4, 4, in_splits=0)
    with pytest.raises(RuntimeError, match="out_splits=5"):
        TiledLinear(4, 4, out_splits=5)
    with pytest.raises(ValueError, match="need a weight of shape"):
        TiledLinear(4, 4).copy_params_from(nn.Linear(4, 3))
    with pytest.raises(ValueError, match="has no bias"):
        TiledLinear(4, 4, bias=False).copy_params_from(nn.Linear(4, 4))
