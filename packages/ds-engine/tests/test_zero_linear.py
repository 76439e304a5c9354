"""`deepspeed.runtime.zero.linear`: LinearModuleForZeroStage3 computes what nn.Linear computes (values and
gradients, any input rank), and backward runs in forward's autocast state, as torch's custom_fwd/custom_bwd define."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import ds_comm

pytest.importorskip("ds_zero", reason="deepspeed.runtime.zero needs ds-zero: pip install 'ds-engine[zero]'")

from ds_engine.runtime.zero import linear  # noqa: E402 - after the skip


def _pair(bias: bool, dtype: torch.dtype = torch.float64) -> tuple[linear.LinearModuleForZeroStage3, nn.Linear]:
    torch.manual_seed(7)
    ours = linear.LinearModuleForZeroStage3(6, 5, bias=bias).to(dtype)
    torch.manual_seed(7)
    reference = nn.Linear(6, 5, bias=bias).to(dtype)
    return ours, reference


def _grads(module: nn.Module, x: torch.Tensor, weight: torch.Tensor) -> list[torch.Tensor]:
    x = x.clone().requires_grad_(True)
    out = module(x)
    (out * weight).sum().backward()
    grads = [out.detach(), x.grad]
    grads += [p.grad for p in module.parameters()]
    return grads


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(6,), (3, 6), (2, 4, 6)])
def test_values_and_gradients_equal_nn_linear(bias: bool, shape: tuple[int, ...]) -> None:
    ours, reference = _pair(bias)
    assert ours.weight.equal(reference.weight)  # nn.Linear's initialisation, draw for draw
    if bias:
        assert ours.bias is not None and reference.bias is not None and ours.bias.equal(reference.bias)
    else:
        assert ours.bias is None and ours._parameters.keys() == reference._parameters.keys()  # bias registered as None
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    weight = torch.randn((*shape[:-1], 5), generator=g, dtype=torch.float64)
    for got, want in zip(_grads(ours, x, weight), _grads(reference, x, weight), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert ours.state_dict().keys() == reference.state_dict().keys()
    assert repr(ours).endswith(f"(in_features=6, out_features=5, bias={bias})")


@pytest.mark.parametrize("shape", [(6,), (4, 6), (2, 3, 6)])
def test_autocast_forward_and_backward_match_f_linear_under_autocast(shape: tuple[int, ...]) -> None:
    ours, reference = _pair(True, torch.float32)
    g = torch.Generator().manual_seed(1)
    x, weight = torch.randn(shape, generator=g), torch.randn((*shape[:-1], 5), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ours(x)
        want = reference(x)
    assert out.dtype == want.dtype == torch.bfloat16
    # one bf16 rounding apart: F.linear adds the bias inside its kernel, DeepSpeed's function after the matmul
    torch.testing.assert_close(out, want, rtol=1.6e-2, atol=1e-2)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = ours(x1), reference(x2)
    (a.float() * weight).sum().backward()
    (b.float() * weight).sum().backward()
    assert x1.grad is not None and x2.grad is not None and x1.grad.dtype == torch.float32
    # both ran their backward matmuls in bf16: the same values up to bf16 rounding of the operands' order
    torch.testing.assert_close(x1.grad, x2.grad, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(ours.weight.grad, reference.weight.grad, rtol=2e-2, atol=2e-2)


def test_backward_runs_without_autocast_when_forward_did() -> None:
    ours, reference = _pair(True, torch.float32)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 6, generator=g)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ours(x1).sum().backward()
    expected_input_grad = reference.weight.sum(0).expand(8, 6)
    out = ours(x2)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # an outer autocast region around backward only
        out.sum().backward()
    torch.testing.assert_close(x2.grad, x1.grad, rtol=0, atol=0)  # fp32, not bf16-rounded
    torch.testing.assert_close(x1.grad, expected_input_grad.detach(), rtol=1e-6, atol=1e-6)


def test_autocast_decorators_are_torch_amp_bound_to_the_accelerator() -> None:
    device = ds_comm.get_accelerator().device_name()
    for decorator, torch_function in (
        (linear.autocast_custom_fwd, torch.amp.custom_fwd),
        (linear.autocast_custom_bwd, torch.amp.custom_bwd),
    ):
        assert isinstance(decorator, functools.partial) and decorator.func is torch_function
        assert decorator.keywords == {"device_type": device}


def test_zero3_linear_wrap_is_f_linear() -> None:
    g = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(2, 3, 6, generator=g), torch.randn(5, 6, generator=g), torch.randn(5, generator=g)
    torch.testing.assert_close(linear.zero3_linear_wrap(x, w, b), nn.functional.linear(x, w, b))
    torch.testing.assert_close(linear.zero3_linear_wrap(x, w), nn.functional.linear(x, w))


def test_torch_func_grad_runs_through_zero3_linear_wrap() -> None:
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(3, 5, generator=g), torch.randn(2, 5, generator=g)
    grad_w = torch.func.grad(lambda w_: linear.zero3_linear_wrap(x, w_).pow(2).sum())(w)
    w64 = w.double().requires_grad_()
    (x.double() @ w64.t()).pow(2).sum().backward()
    torch.testing.assert_close(grad_w.double(), w64.grad, rtol=1e-5, atol=1e-6)


def test_one_stage3_linear_object_across_the_deepspeed_paths() -> None:
    import ds_zero
    from ds_engine.runtime.zero import partition_parameters

    assert linear.zero3_linear_wrap is ds_zero.zero3_linear_wrap is partition_parameters.zero3_linear_wrap
    assert linear.LinearFunctionForZeroStage3 is ds_zero.LinearFunctionForZeroStage3
    original = nn.functional.linear
    partition_parameters.InsertPostInitMethodToModuleSubClasses()._enable_mem_efficient_linear()
    # installed process-wide (the conftest fixture restores torch's after this test)
    assert nn.functional.linear is linear.zero3_linear_wrap is partition_parameters.zero3_linear_wrap
    assert partition_parameters.InsertPostInitMethodToModuleSubClasses.linear_bk is original
