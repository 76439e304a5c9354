"""`zero3_linear_wrap` / `LinearFunctionForZeroStage3` against plain PyTorch.

Numerics: values and gradients of input, weight and bias against `x @ w.T + b` computed in float64,
float32 tolerance (rtol 1e-5, atol 1e-6), for 1-D, 2-D and 3-D inputs, with and without bias, and for
every subset of inputs that requires grad; values bit-identical to DeepSpeed's (in bf16 that is not torch's
fused linear kernel: the bias is added after the product). Where autograd records nothing the wrap computes
the same values with no graph node; where it records, the node is DeepSpeed's
function with DeepSpeed's ctx attributes, backward runs in forward's autocast state, and `torch.func`
transforms run through it. (The process-wide install is tested in test_stage3_handles_and_init.py, in a
fresh interpreter.)
"""

from __future__ import annotations

import itertools

import pytest
import torch

from ds_zero import LinearFunctionForZeroStage3, zero3_linear_wrap
from ds_zero._construct.linear import deepspeed_linear_values

_SHAPES = [(7,), (4, 7), (2, 3, 7)]


def _data(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    w = torch.randn(5, 7, generator=g)
    b = torch.randn(5, generator=g)
    upstream = torch.randn((*shape[:-1], 5), generator=g)
    return x, w, b, upstream


@pytest.mark.parametrize("shape", _SHAPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("needs", list(itertools.product([True, False], repeat=3))[:-1])
def test_values_and_gradients_match_float64_reference(
    shape: tuple[int, ...], bias: bool, needs: tuple[bool, bool, bool]
) -> None:
    x, w, b, upstream = _data(shape, seed=len(shape) * 10 + sum(needs))
    inputs = [x.clone().requires_grad_(needs[0]), w.clone().requires_grad_(needs[1])]
    inputs.append(b.clone().requires_grad_(needs[2]) if bias else None)
    out = zero3_linear_wrap(*inputs)
    if not any(t is not None and t.requires_grad for t in inputs):  # only the bias would, and there is none
        assert out.grad_fn is None and torch.equal(out, deepspeed_linear_values(x, w, None))
        return
    assert type(out.grad_fn).__name__.startswith("LinearFunctionForZeroStage3")
    (out * upstream).sum().backward()

    ref = [t.double().requires_grad_() if t is not None else None for t in (x, w, b if bias else None)]
    want = ref[0] @ ref[1].t() + (ref[2] if bias else 0)
    (want * upstream.double()).sum().backward()
    assert torch.equal(out.detach(), deepspeed_linear_values(x, w, b if bias else None))
    torch.testing.assert_close(out.detach().double(), want.detach(), rtol=1e-5, atol=1e-6)
    for got, reference, needed in zip(inputs, ref, needs, strict=True):
        if got is None:
            continue
        if needed:
            assert got.grad is not None and reference is not None and reference.grad is not None
            torch.testing.assert_close(got.grad.double(), reference.grad, rtol=1e-5, atol=1e-6)
        else:
            assert got.grad is None


@pytest.mark.parametrize("shape", _SHAPES)
def test_no_graph_where_autograd_records_nothing(shape: tuple[int, ...]) -> None:
    x, w, b, _ = _data(shape, seed=3)
    plain = zero3_linear_wrap(x, w, b)
    assert plain.grad_fn is None and torch.equal(plain, deepspeed_linear_values(x, w, b))
    with torch.no_grad():
        out = zero3_linear_wrap(x, w.requires_grad_(), b)
    assert out.grad_fn is None and not out.requires_grad and torch.equal(out, plain)
    with torch.inference_mode():
        assert torch.equal(zero3_linear_wrap(x, w, b), plain)


def test_backward_runs_in_forwards_autocast_state() -> None:
    x, w, b, upstream = _data((4, 7), seed=5)
    xs = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = zero3_linear_wrap(xs, w.clone().requires_grad_(), b)
        want = torch.nn.functional.linear(x.clone().requires_grad_(), w, b)
    assert out.dtype == want.dtype == torch.bfloat16
    assert torch.equal(out, want), "torch's kernel under autocast: the same bf16 values"
    assert out.grad_fn._fwd_used_autocast is True and out.grad_fn._dtype == torch.bfloat16
    assert out.grad_fn._device_type == "cpu"
    (out.float() * upstream).sum().backward()
    assert xs.grad is not None and xs.grad.dtype == torch.float32
    # the backward matmul ran in bf16: within bf16 rounding of the fp32 product
    torch.testing.assert_close(xs.grad, upstream @ w, rtol=2e-2, atol=5e-2)

    # forward without autocast, backward inside an autocast region: backward stays fp32 (exact)
    xs = x.clone().requires_grad_()
    out = zero3_linear_wrap(xs, w, b)
    assert out.grad_fn._fwd_used_autocast is False
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (out * upstream).sum().backward()
    assert torch.equal(xs.grad, upstream.mm(w))


def test_torch_func_grad_and_vmap_run_through_it() -> None:
    x, w, _, _ = _data((3, 7), seed=9)
    grad_w = torch.func.grad(lambda w_: zero3_linear_wrap(x, w_).pow(2).sum())(w)
    w64 = w.double().requires_grad_()
    (x.double() @ w64.t()).pow(2).sum().backward()
    torch.testing.assert_close(grad_w.double(), w64.grad, rtol=1e-5, atol=1e-6)
    batched = torch.func.vmap(lambda row: zero3_linear_wrap(row, w))(x)
    torch.testing.assert_close(batched, x @ w.t(), rtol=1e-5, atol=1e-6)
    per_sample = torch.func.vmap(torch.func.grad(lambda w_, row: zero3_linear_wrap(row, w_).sum()), in_dims=(None, 0))
    torch.testing.assert_close(per_sample(w, x), x[:, None, :].expand(3, 5, 7), rtol=1e-6, atol=1e-6)


def test_apply_of_the_function_itself_matches_the_wrap() -> None:
    x, w, b, _ = _data((2, 7), seed=11)
    w = w.requires_grad_()
    assert torch.equal(LinearFunctionForZeroStage3.apply(x, w, b), zero3_linear_wrap(x, w, b))
    assert torch.equal(LinearFunctionForZeroStage3.apply(x, w), zero3_linear_wrap(x, w))


def test_bf16_values_are_deepspeeds_product_then_bias() -> None:
    """DeepSpeed's stage-3 linear rounds the product to bf16 before adding the bias (for inputs of more than 2
    dims); torch's linear kernel rounds once. A ZeRO-3 run prints DeepSpeed's bf16 losses only with the former."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 32, 64, generator=g).bfloat16()
    w = torch.randn(256, 64, generator=g).bfloat16()
    b = torch.randn(256, generator=g).bfloat16()
    deepspeeds = x.matmul(w.t()) + b
    for grad in (False, True):
        out = zero3_linear_wrap(x, w.requires_grad_(grad), b)
        assert torch.equal(out.detach(), deepspeeds)
    assert not torch.equal(deepspeeds, torch._C._nn.linear(x, w, b))  # the two roundings differ here
    x2 = x[0]  # 2-D with a bias: one fused multiply-add, as both compute it
    assert torch.equal(zero3_linear_wrap(x2, w, b).detach(), torch.addmm(b, x2, w.t()))


def test_a_large_weight_compiles_as_one_graph() -> None:
    """torch.compile (DeepCompile's capture) traces the backward: a weight gradient of pooled size
    (>= 8 MiB) must not reach the released-storage pool there (a storage built in Python is a graph
    break, which sent DeepCompile back to its eager hooks on the benchmark's GPT)."""
    from ds_zero._params.storage_pool import MIN_POOLED_BYTES

    out_features = MIN_POOLED_BYTES // 4 // 256  # an fp32 weight of exactly the pooled minimum
    weight = torch.nn.Parameter(torch.randn(out_features, 256) * 0.01)
    x = torch.randn(4, 256, requires_grad=True)

    def loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return zero3_linear_wrap(x, w).square().sum()

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)  # raises on a graph break
    compiled(x, weight).backward()
    got = weight.grad.clone(), x.grad.clone()
    weight.grad = x.grad = None
    loss(x, weight).backward()
    torch.testing.assert_close(got[0], weight.grad)
    torch.testing.assert_close(got[1], x.grad)
