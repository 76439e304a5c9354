"""Muon: Newton–Schulz against a reference written out here, MuonWithAuxAdam against a plain training loop.

Newton–Schulz alone: 1e-12 in fp64 and 3e-6 in fp32 (a different association of the same
polynomial); optimizer trajectories: 1e-6 absolute (fp32, parameters of order 0.1). torch's own
`torch.optim.Muon` runs Newton–Schulz in bf16, so it is compared at bf16 precision (relative 2e-2
on the parameter change).
"""

from __future__ import annotations

import math

import pytest
import torch

from ds_ops import MuonWithAuxAdam, muon_update, newton_schulz_orthogonalize

A, B, C = 3.4445, -4.7750, 2.0315


def ref_orthogonalize(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Keller Jordan's quintic iteration, written out term by term."""
    x = g.clone()
    transpose = x.shape[0] > x.shape[1]
    if transpose:
        x = x.t()
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.t()
        x = A * x + B * (gram @ x) + C * (gram @ (gram @ x))
    return x.t() if transpose else x


def ref_muon_step(p: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor, lr: float, beta: float, wd: float) -> None:
    buf.mul_(beta).add_(grad, alpha=1 - beta)
    direction = grad * (1 - beta) + buf * beta  # Nesterov
    update = ref_orthogonalize(direction) * math.sqrt(max(1.0, p.shape[0] / p.shape[1]))
    p.mul_(1 - lr * wd).sub_(lr * update)


@pytest.mark.parametrize("shape", [(16, 16), (12, 40), (40, 12)])
def test_newton_schulz_matches_reference(shape: tuple[int, int]) -> None:
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    out = newton_schulz_orthogonalize(g, steps=5)
    exact = ref_orthogonalize(g.double())
    torch.testing.assert_close(newton_schulz_orthogonalize(g.double()), exact, rtol=0, atol=1e-12)
    torch.testing.assert_close(out.double(), exact, rtol=0, atol=3e-6)  # fp32 rounding only
    svals = torch.linalg.svdvals(out.double())
    assert svals.min() > 0.5 and svals.max() < 1.3, svals  # close to orthogonal: U S' V^T with S' near 1


def test_newton_schulz_batches_and_keeps_dtype() -> None:
    g = torch.randn(3, 8, 20, generator=torch.Generator().manual_seed(1))
    out = newton_schulz_orthogonalize(g)
    for i in range(3):
        torch.testing.assert_close(out[i], ref_orthogonalize(g[i]), rtol=0, atol=1e-6)
    assert newton_schulz_orthogonalize(g.bfloat16()).dtype == torch.bfloat16
    assert torch.count_nonzero(newton_schulz_orthogonalize(torch.zeros(4, 6))) == 0


def _model_params(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden": torch.randn(24, 16, generator=g) * 0.1,
        "wide": torch.randn(8, 24, generator=g) * 0.1,
        "bias": torch.randn(24, generator=g) * 0.1,
        "embed": torch.randn(10, 16, generator=g) * 0.1,
    }


def test_muon_with_aux_adam_matches_reference_loop() -> None:
    muon_names, adam_names = ["hidden", "wide"], ["bias", "embed"]
    ours = {k: v.clone().requires_grad_() for k, v in _model_params().items()}
    ref = {k: v.clone() for k, v in _model_params().items()}
    opt = MuonWithAuxAdam(
        [
            {"params": [ours[n] for n in muon_names], "use_muon": True, "lr": 0.05, "weight_decay": 0.1},
            {"params": [ours[n] for n in adam_names], "use_muon": False, "lr": 1e-2, "weight_decay": 0.01},
        ]
    )
    ref_adam = torch.optim.AdamW([ref[n].requires_grad_() for n in adam_names], lr=1e-2, betas=(0.9, 0.95),
                                 eps=1e-10, weight_decay=0.01)  # fmt: skip
    bufs = {n: torch.zeros_like(ref[n]) for n in muon_names}
    g = torch.Generator().manual_seed(5)
    for _ in range(4):
        grads = {k: torch.randn(v.shape, generator=g) for k, v in ref.items()}
        for k in ours:
            ours[k].grad = grads[k].clone()
        opt.step()
        with torch.no_grad():
            for n in muon_names:
                ref_muon_step(ref[n], grads[n], bufs[n], lr=0.05, beta=0.95, wd=0.1)
        for n in adam_names:
            ref[n].grad = grads[n].clone()
        ref_adam.step()
    for k in ours:
        torch.testing.assert_close(ours[k].detach(), ref[k].detach(), rtol=0, atol=1e-6)
    for n in muon_names:
        torch.testing.assert_close(opt.state[ours[n]]["momentum_buffer"], bufs[n], rtol=0, atol=1e-6)


def test_adam_groups_l2_mode() -> None:
    p = torch.randn(6, generator=torch.Generator().manual_seed(2)).requires_grad_()
    q = p.detach().clone().requires_grad_()
    opt = MuonWithAuxAdam([{"params": [p], "use_muon": False, "weight_decay": 0.1}], adam_w_mode=False)
    ref = torch.optim.Adam([q], lr=3e-4, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.1)
    for i in range(3):
        grad = torch.full((6,), 0.5 * (i + 1))
        p.grad, q.grad = grad.clone(), grad.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-6)


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="this torch has no torch.optim.Muon")
def test_close_to_torch_muon() -> None:
    w0 = torch.randn(32, 16, generator=torch.Generator().manual_seed(3)) * 0.1
    ours = w0.clone().requires_grad_()
    theirs = w0.clone().requires_grad_()
    opt = MuonWithAuxAdam([{"params": [ours], "use_muon": True, "lr": 0.02, "weight_decay": 0.1}])
    ref = torch.optim.Muon([theirs], lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr_fn="original")
    g = torch.Generator().manual_seed(4)
    for _ in range(3):
        grad = torch.randn(32, 16, generator=g)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        opt.step()
        ref.step()
    d_ours, d_theirs = ours.detach() - w0, theirs.detach() - w0
    assert (d_ours - d_theirs).norm() / d_theirs.norm() < 2e-2  # bf16 Newton-Schulz in torch


def test_non_finite_gradient_keeps_momentum() -> None:
    momentum = torch.ones(4, 5)
    grad = torch.randn(4, 5)
    grad[1, 2] = float("inf")
    out = muon_update(grad, momentum)
    assert torch.equal(momentum, torch.ones(4, 5))
    assert not torch.isfinite(out).all()  # the overflow stays visible to the caller's check


def test_conv_weight_is_orthogonalized_as_matrix() -> None:
    grad = torch.randn(8, 3, 2, 2, generator=torch.Generator().manual_seed(6))
    update = muon_update(grad, torch.zeros_like(grad), beta=0.0)
    torch.testing.assert_close(update.view(8, -1), ref_orthogonalize(grad.view(8, -1)), rtol=0, atol=1e-6)


def test_bad_groups_are_named() -> None:
    w, b = torch.zeros(4, 4, requires_grad=True), torch.zeros(4, requires_grad=True)
    with pytest.raises(ValueError, match="no 'use_muon' flag"):
        MuonWithAuxAdam([{"params": [w]}])
    with pytest.raises(ValueError, match=r"Muon needs matrices .*\(4,\)"):
        MuonWithAuxAdam([{"params": [b], "use_muon": True}])
    with pytest.raises(ValueError, match="ns_method must be one of"):
        MuonWithAuxAdam([{"params": [w], "use_muon": True, "ns_method": "svd"}])
    with pytest.raises(ValueError, match="momentum must be in"):
        MuonWithAuxAdam([{"params": [w], "use_muon": True, "momentum": 1.5}])


def test_flat_partition_needs_the_zero_mark() -> None:
    w = torch.zeros(4, 4, requires_grad=True)
    opt = MuonWithAuxAdam([{"params": [w], "use_muon": True, "lr": 0.5}])
    part = torch.ones(8, requires_grad=True)
    opt.param_groups[0]["params"] = [part]  # what a ZeRO optimizer does
    part.grad = torch.full((8,), 2.0)
    with pytest.raises(RuntimeError, match="no ZeRO optimizer prepared"):
        opt.step()
    part.muon_update_in_grad = True  # type: ignore[attr-defined]
    opt.step()
    assert torch.equal(part.detach(), torch.zeros(8))  # 1 - 0.5 * 2: the gradient is the update


@pytest.mark.parametrize("shape, heads", [((12, 5), 4), ((8, 3), 2), ((6, 10), 3)])
def test_per_head_update_orthogonalizes_each_head(shape: tuple[int, int], heads: int) -> None:
    """`num_heads`: each block of rows is its own Muon matrix (scaled by its own aspect ratio)."""
    g = torch.Generator().manual_seed(3)
    grad = torch.randn(shape, generator=g)
    buf = torch.randn(shape, generator=g)
    ref_buf = buf.clone()
    ref_buf.lerp_(grad, 0.05)
    direction = grad.lerp(ref_buf, 0.95)
    rows, cols = shape[0] // heads, shape[1]
    scale = math.sqrt(rows / cols) if rows > cols else 1.0
    expected = torch.cat([ref_orthogonalize(block) * scale for block in direction.split(rows)])
    got = muon_update(grad, buf, beta=0.95, num_heads=heads)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(buf, ref_buf)
    assert (got - muon_update(grad, ref_buf.clone(), beta=0.95)).abs().max() > 1e-2  # not the whole-matrix update


def test_per_head_tag_reaches_the_optimizer_and_bad_counts_are_named() -> None:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(8, 6))
    w.muon_num_heads = 2
    w.grad = torch.randn(8, 6)
    expected = w.detach().clone() - 0.1 * muon_update(w.grad.clone(), torch.zeros(8, 6), beta=0.9, num_heads=2)
    MuonWithAuxAdam([{"params": [w], "use_muon": True, "lr": 0.1, "momentum": 0.9}]).step()
    torch.testing.assert_close(w.detach(), expected)
    with pytest.raises(ValueError, match=r"rows of a \(8, 6\) matrix do not split into num_heads=3"):
        muon_update(torch.randn(8, 6), torch.zeros(8, 6), num_heads=3)
    with pytest.raises(ValueError, match="per-head Muon needs a 2-D"):
        muon_update(torch.randn(2, 4, 6), torch.zeros(2, 4, 6), num_heads=2)


def test_muon_update_takes_deepspeeds_ns_method_and_expert_flag() -> None:
    """Both of DeepSpeed's Newton-Schulz variants compute one function in ds; an unknown one is refused."""
    from ds_ops.muon import muon_update

    g = torch.randn(6, 4, generator=torch.Generator().manual_seed(3))
    plain = muon_update(g, torch.zeros_like(g), beta=0.9)
    for method in ("gram", "standard"):
        m = torch.zeros_like(g)
        torch.testing.assert_close(muon_update(g, m, beta=0.9, ns_method=method, is_expert_group=True), plain)
    with pytest.raises(ValueError, match="ns_method must be one of"):
        muon_update(g, torch.zeros_like(g), ns_method="svd")
