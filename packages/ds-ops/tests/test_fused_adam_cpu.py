"""FusedAdam on CPU tensors (the fused_adam op of a CPU accelerator) against torch.optim.AdamW / Adam.

fp32: 100 steps over three param groups (sizes 0 to 4097, weight decay on and off), parameters and
both moments within rtol=1e-5, atol=1e-6 (fp32 math in torch's order without FMA; torch's lerp
uses FMA, so a few ulps differ). bf16/fp16 parameters keep their moments in the parameter dtype (as
DeepSpeed's FusedAdam does), each rounded once per step: checked against torch's fp32 AdamW whose
parameter and moments are rounded to that dtype after every step, to one ulp of the dtype (rtol
2**-7 for bf16, 2**-10 for fp16).
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from _optim_cases import set_grads

from ds_ops import FusedAdam
from ds_ops.op_builder import CPUFusedAdamBuilder, FusedAdamBuilder, OpBuilder, host_op_builders

TOL = {"rtol": 1e-5, "atol": 1e-6}
SIZES = ((0, 1, 7), (4097,), (33, 512))
HYPER = ({"weight_decay": 0.0}, {"lr": 3e-3, "weight_decay": 0.1}, {"lr": 5e-4, "weight_decay": 0.01})


def _groups(dtype: torch.dtype = torch.float32) -> list[dict[str, Any]]:
    generator = torch.Generator().manual_seed(0)
    return [
        {"params": [torch.nn.Parameter(torch.randn(n, generator=generator).to(dtype)) for n in sizes], **hyper}
        for sizes, hyper in zip(SIZES, HYPER, strict=True)
    ]


def _clone(groups: list[dict[str, Any]], dtype: torch.dtype | None = None) -> list[dict[str, Any]]:
    return [
        {**g, "params": [torch.nn.Parameter(p.detach().clone().to(dtype or p.dtype)) for p in g["params"]]}
        for g in groups
    ]


def _flat(groups: list[dict[str, Any]]) -> list[torch.Tensor]:
    return [p for g in groups for p in g["params"]]


@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "adam_l2"])
def test_fp32_matches_torch_over_100_steps(adam_w_mode: bool) -> None:
    groups = _groups()
    ref_groups = _clone(groups)
    ours = FusedAdam(groups, lr=1e-3, adam_w_mode=adam_w_mode)
    reference = (torch.optim.AdamW if adam_w_mode else torch.optim.Adam)(ref_groups, lr=1e-3, foreach=False)
    for step in range(100):
        set_grads(step, _flat(groups), _flat(ref_groups))
        ours.step()
        reference.step()
    for mine, theirs in zip(_flat(groups), _flat(ref_groups), strict=True):
        torch.testing.assert_close(mine, theirs, **TOL)
        if mine.numel():
            for key in ("exp_avg", "exp_avg_sq"):
                assert ours.state[mine][key].dtype == torch.float32
                torch.testing.assert_close(ours.state[mine][key], reference.state[theirs][key], **TOL)
    assert [ours.state[p]["step"] for p in _flat(groups) if p.numel()] == [100] * 5


@pytest.mark.parametrize(("dtype", "ulp"), [(torch.bfloat16, 2**-7), (torch.float16, 2**-10)], ids=["bf16", "fp16"])
def test_half_params_keep_moments_in_their_dtype(dtype: torch.dtype, ulp: float) -> None:
    groups = _groups(dtype)
    ref_groups = _clone(groups, torch.float32)
    ours = FusedAdam(groups, lr=1e-3)
    reference = torch.optim.AdamW(ref_groups, lr=1e-3, foreach=False)
    for step in range(30):
        set_grads(step, _flat(groups), _flat(ref_groups))
        for p in _flat(ref_groups):  # the gradient the kernel reads: rounded to the parameter dtype
            p.grad = p.grad.to(dtype).float()
        ours.step()
        reference.step()
        with torch.no_grad():  # the kernel rounds parameter and moments once per step, to the dtype
            for p in _flat(ref_groups):
                p.copy_(p.to(dtype))
                for key in ("exp_avg", "exp_avg_sq"):
                    state = reference.state[p][key]
                    state.copy_(state.to(dtype))
    for mine, theirs in zip(_flat(groups), _flat(ref_groups), strict=True):
        assert mine.dtype == dtype
        torch.testing.assert_close(mine.float(), theirs, rtol=ulp, atol=1e-5)
        if mine.numel():
            assert ours.state[mine]["exp_avg"].dtype == dtype
            torch.testing.assert_close(
                ours.state[mine]["exp_avg"].float(), reference.state[theirs]["exp_avg"], rtol=ulp, atol=1e-6
            )


def test_bias_correction_off_matches_a_reference() -> None:
    params = [torch.nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(n))) for n in (7, 4097)]
    ref = [p.detach().clone() for p in params]
    moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in ref]
    lr, (beta1, beta2), eps, weight_decay = 1e-3, (0.9, 0.999), 1e-8, 0.05
    ours = FusedAdam(params, lr=lr, bias_correction=False, weight_decay=weight_decay)
    for step in range(50):
        set_grads(step, params)
        ours.step()
        for p, q, (m, v) in zip(params, ref, moments, strict=True):
            q.mul_(1 - lr * weight_decay)
            m.lerp_(p.grad, 1 - beta1)
            v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            q.addcdiv_(m, v.sqrt().add_(eps), value=-lr)
    for p, q in zip(params, ref, strict=True):
        torch.testing.assert_close(p.detach(), q, **TOL)


def test_mixed_dtypes_and_a_non_contiguous_parameter_in_one_group() -> None:
    base = torch.randn(40, 30, generator=torch.Generator().manual_seed(3))
    strided = torch.nn.Parameter(base.t())  # non-contiguous view
    half = torch.nn.Parameter(base[:5].bfloat16())
    ref_strided = torch.nn.Parameter(base.t().clone())
    ours = FusedAdam([strided, half], lr=1e-2, weight_decay=0.01)
    reference = torch.optim.AdamW([ref_strided], lr=1e-2, weight_decay=0.01, foreach=False)
    for step in range(5):
        grad = torch.randn(30, 40, generator=torch.Generator().manual_seed(step))
        strided.grad, ref_strided.grad = grad, grad.clone()
        half.grad = grad.t()[:5].bfloat16()
        ours.step()
        reference.step()
    assert not strided.is_contiguous()
    torch.testing.assert_close(strided.detach(), ref_strided.detach(), **TOL)
    assert not torch.equal(half.detach(), base[:5].bfloat16())


def test_state_dict_round_trip_resumes_identically() -> None:
    groups = _groups()
    ours = FusedAdam(groups, lr=1e-3)
    for step in range(3):
        set_grads(step, _flat(groups))
        ours.step()
    buffer = io.BytesIO()
    torch.save(ours.state_dict(), buffer)
    resumed_groups = _clone(groups)
    resumed = FusedAdam(resumed_groups, lr=1e-3)
    buffer.seek(0)
    resumed.load_state_dict(torch.load(buffer))
    for step in range(3, 6):
        set_grads(step, _flat(groups), _flat(resumed_groups))
        ours.step()
        resumed.step()
    for p, q in zip(_flat(groups), _flat(resumed_groups), strict=True):
        assert torch.equal(p, q)


def test_bad_input_is_refused_before_any_work() -> None:
    with pytest.raises(ValueError, match="amsgrad=True is not supported"):
        FusedAdam([torch.nn.Parameter(torch.zeros(3))], amsgrad=True)
    with pytest.raises(ValueError, match="FusedAdam updates CUDA or CPU tensors"):
        FusedAdam([torch.nn.Parameter(torch.zeros(3, device="meta"))])
    with pytest.raises(TypeError, match="dtype torch.float64"):
        FusedAdam([torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))])
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer = FusedAdam([param])
    with pytest.raises(ValueError, match="betas\\[1\\]=1.5"):
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "betas": (0.9, 1.5)})
    assert len(optimizer.param_groups) == 1
    param.grad_dtype = None  # torch refuses a gradient of another dtype unless told to accept one
    param.grad = torch.zeros(3, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="gradient dtype torch.bfloat16 differs"):
        optimizer.step()
    with pytest.raises(ValueError, match="legacy"):
        optimizer.step(scale=2.0)


def test_the_cpu_accelerator_reports_the_cpu_op(monkeypatch: pytest.MonkeyPatch) -> None:
    import ds_comm  # noqa: PLC0415

    builders = host_op_builders()
    expected: type[OpBuilder] = (
        CPUFusedAdamBuilder if ds_comm.get_accelerator().device_name() == "cpu" else FusedAdamBuilder
    )
    assert builders["fused_adam"] is expected
    assert CPUFusedAdamBuilder.NAME == FusedAdamBuilder.NAME == "fused_adam"
    assert CPUFusedAdamBuilder().is_compatible()
    library = CPUFusedAdamBuilder().load()
    assert hasattr(library, "ds_cpu_adam_step")
    path, why = CPUFusedAdamBuilder().prebuilt_library()
    assert path is None and "CUDA" in why


def test_a_frozen_non_float_parameter_is_accepted_and_left_alone() -> None:
    """A frozen quantized weight (uint8, `deepspeed.linear`) rides along in the groups a model hands over."""
    frozen = torch.nn.Parameter(torch.arange(6, dtype=torch.uint8), requires_grad=False)
    trained = torch.nn.Parameter(torch.ones(3))
    opt = FusedAdam([frozen, trained], lr=0.1)
    trained.grad = torch.ones(3)
    opt.step()
    assert torch.equal(frozen, torch.arange(6, dtype=torch.uint8)) and not torch.equal(trained, torch.ones(3))
