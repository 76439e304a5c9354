"""`zero3_linear_wrap` against plain PyTorch, and `F.linear` left alone by `Init` / stage 3.

Numerics: values and gradients of input, weight and bias against `x @ w.T + b` computed in float64,
float32 tolerance (rtol 1e-5, atol 1e-6), for 1-D, 2-D and 3-D inputs with and without bias; and
through `torch.func.grad`. The no-patch check runs in a fresh interpreter: DeepSpeed replaces
`F.linear` for the rest of the process; ds does not (its saved-tensor hooks re-gather for every op).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from ds_zero import zero3_linear_wrap

TOL = {"rtol": 1e-5, "atol": 1e-6}


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().t()
    return out + b.double() if b is not None else out


@pytest.mark.parametrize("shape", [(7,), (5, 7), (2, 3, 7)])
@pytest.mark.parametrize("bias", [True, False])
def test_values_and_gradients_match_plain_pytorch(shape: tuple[int, ...], bias: bool) -> None:
    g = torch.Generator().manual_seed(len(shape) * 10 + bias)
    x = torch.randn(*shape, generator=g, requires_grad=True)
    w = torch.randn(4, 7, generator=g, requires_grad=True)
    b = torch.randn(4, generator=g, requires_grad=True) if bias else None
    grad_out = torch.randn(*shape[:-1], 4, generator=g)

    out = zero3_linear_wrap(x, w, b)
    out.backward(grad_out)
    leaves = [x, w] + ([b] if b is not None else [])
    got = [t.grad for t in leaves]

    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref = _reference(ref_leaves[0], ref_leaves[1], ref_leaves[2] if bias else None)
    ref.backward(grad_out.double())

    torch.testing.assert_close(out.double(), ref.detach(), **TOL)
    for g_got, leaf in zip(got, ref_leaves, strict=True):
        torch.testing.assert_close(g_got.double(), leaf.grad, **TOL)


def test_torch_func_grad_runs_through_it() -> None:
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(3, 5, generator=g), torch.randn(2, 5, generator=g)
    grad_w = torch.func.grad(lambda w_: zero3_linear_wrap(x, w_).pow(2).sum())(w)
    w64 = w.double().requires_grad_()
    (x.double() @ w64.t()).pow(2).sum().backward()
    torch.testing.assert_close(grad_w.double(), w64.grad, **TOL)


def test_under_autocast_values_and_gradients_match_torch_linear_under_autocast() -> None:
    g = torch.Generator().manual_seed(4)
    x0, w0, b0 = torch.randn(6, 8, generator=g), torch.randn(5, 8, generator=g), torch.randn(5, generator=g)
    results = []
    for fn in (zero3_linear_wrap, torch._C._nn.linear):  # torch's own linear, whatever F.linear is now
        x, w, b = (t.clone().requires_grad_() for t in (x0, w0, b0))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(x, w, b)
        out.float().pow(2).sum().backward()
        results.append((out, x.grad, w.grad, b.grad))
    ours, torchs = results
    assert ours[0].dtype is torch.bfloat16
    for a, b in zip(ours, torchs, strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    out = zero3_linear_wrap(x0, w0.requires_grad_())
    assert out.grad_fn._fwd_used_autocast is False  # DeepSpeed's ctx attribute, read by its tests


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(120)
def test_init_and_stage3_leave_torch_linear_alone() -> None:
    script = textwrap.dedent(
        """
        import torch
        import torch.nn.functional as F
        import ds_zero
        from ds_zero import InsertPostInitMethodToModuleSubClasses as Base

        original = F.linear
        on = {"zero_optimization": {"stage": 3, "memory_efficient_linear": True}}
        with ds_zero.Init(config_dict_or_path=on) as init:
            assert isinstance(init, Base) and init.mem_efficient_linear
            torch.nn.Linear(2, 2)
            assert F.linear is original, "entering Init"
        assert F.linear is original, "after Init"
        ds_zero.Init(module=torch.nn.Linear(3, 3), config_dict_or_path=on)
        assert F.linear is original, "Init(module=...)"
        model = torch.nn.Linear(3, 2)
        ds_zero.DeepSpeedZeroOptimizer_Stage3(model, torch.optim.SGD(model.parameters(), lr=0.1), config={"stage": 3})
        assert F.linear is original, "the stage-3 optimizer"
        assert not hasattr(Base, "linear_bk")
        print("OK")
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env["MASTER_PORT"] = str(_free_port())
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("OK")
