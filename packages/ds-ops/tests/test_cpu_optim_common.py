"""Behaviour the three CPU optimizers share: state_dict save/load mid-run, the in-pass bf16/fp16
copy, bf16/fp16 parameters with fp32 or low-precision state, thread-count independence, and
errors raised before any work."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from _optim_cases import set_grads

from ds_ops import DeepSpeedCPUAdagrad, DeepSpeedCPUAdam, DeepSpeedCPULion

OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adam": (DeepSpeedCPUAdam, {"lr": 1e-3, "weight_decay": 0.01}),
    "adagrad": (DeepSpeedCPUAdagrad, {"lr": 1e-2, "weight_decay": 0.01}),
    "lion": (DeepSpeedCPULion, {"lr": 1e-3, "weight_decay": 0.01}),
}
SIZES = (1, 7, 4097, 70_001)


def _params(dtype: torch.dtype = torch.float32, sizes: tuple[int, ...] = SIZES) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(7)
    return [torch.nn.Parameter(torch.randn(n, generator=generator).to(dtype)) for n in sizes]


def _groups(params: list[torch.nn.Parameter]) -> list[dict[str, Any]]:
    return [{"params": params[:2]}, {"params": params[2:], "lr": 2e-3}]


def _run(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], steps: range) -> None:
    for step in steps:
        set_grads(step, params)
        optimizer.step()


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_state_dict_save_and_load_mid_run_continues_identically(name: str) -> None:
    cls, kwargs = OPTIMIZERS[name]
    params = _params()
    optimizer = cls(_groups(params), **kwargs)
    _run(optimizer, params, range(0, 30))
    buffer = io.BytesIO()
    torch.save({"params": [p.detach().clone() for p in params], "optimizer": optimizer.state_dict()}, buffer)
    _run(optimizer, params, range(30, 60))

    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed_params = [torch.nn.Parameter(p) for p in saved["params"]]
    resumed = cls(_groups(resumed_params), **kwargs)
    resumed.load_state_dict(saved["optimizer"])
    _run(resumed, resumed_params, range(30, 60))
    for original, again in zip(params, resumed_params, strict=True):
        torch.testing.assert_close(again, original, rtol=0, atol=0)
        assert resumed.state[again]["step"] == optimizer.state[original]["step"] == 60


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("copy_dtype", [torch.bfloat16, torch.float16])
def test_in_pass_copy_equals_a_separate_cast(name: str, copy_dtype: torch.dtype) -> None:
    cls, kwargs = OPTIMIZERS[name]
    params = _params()
    groups = _groups(params)
    optimizer = cls(groups, **kwargs)
    targets = [[torch.empty(p.shape, dtype=copy_dtype) for p in g["params"]] for g in groups]
    for step in range(5):
        set_grads(step, params)
        optimizer.step(fp16_param_groups=targets)
        for target, param in zip([t for g in targets for t in g], params, strict=True):
            assert torch.equal(target, param.detach().to(copy_dtype)), (step, param.numel())


def test_copy_targets_in_deepspeed_forms() -> None:
    single = torch.nn.Parameter(torch.randn(9))
    optimizer = DeepSpeedCPUAdam([single])
    target = torch.empty(9, dtype=torch.bfloat16)
    single.grad = torch.randn(9)
    optimizer.step(fp16_param_groups=target)  # one tensor
    assert torch.equal(target, single.detach().bfloat16())
    optimizer.step(fp16_param_groups=[target])  # one group as a flat list
    assert torch.equal(target, single.detach().bfloat16())
    optimizer.step(fp16_param_groups=[[None]])  # None: no copy for that parameter
    assert not torch.equal(target, single.detach().bfloat16())


def test_a_bad_copy_target_is_rejected_before_any_update() -> None:
    params = _params()
    groups = _groups(params)
    optimizer = DeepSpeedCPUAdam(groups)
    set_grads(0, params)
    before = [p.detach().clone() for p in params]
    targets = [[torch.empty(p.shape, dtype=torch.bfloat16) for p in g["params"]] for g in groups]
    targets[0][1] = torch.empty(3, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"fp16_param_groups\[0\]\[1\] has 3 elements, its parameter has 7"):
        optimizer.step(fp16_param_groups=targets)
    with pytest.raises(ValueError, match="fp16_param_groups has 1 group"):
        optimizer.step(fp16_param_groups=[targets[0]])
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    assert not optimizer.state


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in units in the last place between same-dtype 16-bit floats (bit patterns as integers)."""

    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)  # sign-magnitude to a monotonic integer line

    return (ordered(a) - ordered(b)).abs()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params_match_an_fp32_master_reference(dtype: torch.dtype) -> None:
    """bf16/fp16 params, fp32 moments: a step is torch AdamW on the widened value, rounded back (<= 1 ulp)."""
    params = _params(dtype)
    optimizer = DeepSpeedCPUAdam(params, lr=1e-2, weight_decay=0.01)
    shadow = [torch.nn.Parameter(p.detach().float()) for p in params]
    reference = torch.optim.AdamW(shadow, lr=1e-2, weight_decay=0.01, foreach=False)
    for step in range(20):
        set_grads(step, params)
        with torch.no_grad():
            for s, p in zip(shadow, params, strict=True):
                s.copy_(p.float())  # both start the step from the same value
                s.grad = p.grad.float()
        optimizer.step()
        reference.step()
        for p, s in zip(params, shadow, strict=True):
            assert int(_ulps_apart(p.detach(), s.detach().to(dtype)).max()) <= 1, step
            assert optimizer.state[p]["exp_avg"].dtype == torch.float32
            torch.testing.assert_close(
                optimizer.state[p]["exp_avg_sq"], reference.state[s]["exp_avg_sq"], rtol=1e-5, atol=1e-6
            )


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fp32_optimizer_states_false_keeps_state_in_the_param_dtype(name: str) -> None:
    cls, kwargs = OPTIMIZERS[name]
    params = _params(torch.bfloat16, sizes=(7, 4097))
    optimizer = cls(params, fp32_optimizer_states=False, **kwargs)
    _run(optimizer, params, range(3))
    states = [t for p in params for t in optimizer.state[p].values() if torch.is_tensor(t)]
    assert states and all(t.dtype == torch.bfloat16 for t in states)
    assert all(torch.isfinite(p).all() for p in params)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_load_state_dict_keeps_fp32_state_of_bf16_params(name: str) -> None:
    """torch's Optimizer.load_state_dict would cast the moments to bf16; ours keeps fp32 bits."""
    cls, kwargs = OPTIMIZERS[name]
    params = _params(torch.bfloat16, sizes=(4097,))
    optimizer = cls(params, **kwargs)
    _run(optimizer, params, range(3))
    saved = optimizer.state_dict()
    resumed = cls([torch.nn.Parameter(p.detach().clone()) for p in params], **kwargs)
    resumed.load_state_dict(saved)
    for key, value in optimizer.state[params[0]].items():
        loaded = next(iter(resumed.state.values()))[key]
        if torch.is_tensor(value):
            assert loaded.dtype == torch.float32
            assert torch.equal(loaded, value) and loaded.data_ptr() != value.data_ptr()


def test_loads_a_torch_adam_state_dict() -> None:
    params = _params(sizes=(7,))
    torch_adam = torch.optim.AdamW(params, lr=1e-3)
    _run(torch_adam, params, range(3))
    ours = DeepSpeedCPUAdam(params, lr=1e-3)
    ours.load_state_dict(torch_adam.state_dict())
    assert ours.state[params[0]]["step"] == 3
    torch.testing.assert_close(ours.state[params[0]]["exp_avg"], torch_adam.state[params[0]]["exp_avg"])


def test_state_dict_of_another_optimizer_is_rejected_before_loading() -> None:
    params = _params(sizes=(7,))
    lion = DeepSpeedCPULion(params)
    _run(lion, params, range(2))
    adam = DeepSpeedCPUAdam(params)
    with pytest.raises(ValueError, match=r"state of parameter 0 has no \['exp_avg_sq'\]; it was saved by another"):
        adam.load_state_dict(lion.state_dict())
    assert not adam.state and adam.param_groups[0]["lr"] == 1e-3


def test_state_of_another_size_is_rejected_before_loading() -> None:
    """Same keys, another numel: the kernel would run past the state's memory; refused up front."""
    small, big = _params(sizes=(7,)), _params(sizes=(4097,))
    saved_from = DeepSpeedCPUAdam(small)
    _run(saved_from, small, range(2))
    adam = DeepSpeedCPUAdam(big, lr=5e-4)
    with pytest.raises(ValueError, match=r"parameter 0 has exp_avg of 7 elements, the parameter has 4097"):
        adam.load_state_dict(saved_from.state_dict())
    assert not adam.state and adam.param_groups[0]["lr"] == 5e-4


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_result_does_not_depend_on_thread_count(name: str) -> None:
    cls, kwargs = OPTIMIZERS[name]
    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            params = _params(sizes=(1_000_003,))
            _run(cls(params, **kwargs), params, range(3))
        finally:
            torch.set_num_threads(1)
        results.append(params[0].detach())
    assert torch.equal(results[0], results[1])


def test_params_with_different_step_counts_in_one_group_match_torch() -> None:
    """A parameter without a gradient is skipped (as torch does), so its step count falls behind: the
    group is then updated in one kernel call per distinct step count, each with its own bias correction."""
    params = _params(sizes=(7, 4097, 70_001))
    reference_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours = DeepSpeedCPUAdam(params, lr=1e-2, weight_decay=0.01)
    reference = torch.optim.AdamW(reference_params, lr=1e-2, weight_decay=0.01, foreach=False)
    for step in range(8):
        set_grads(step, params, reference_params)
        if step < 3:
            params[1].grad = reference_params[1].grad = None
        ours.step()
        reference.step()
    assert [ours.state[p]["step"] for p in params] == [8, 5, 8]
    for mine, theirs in zip(params, reference_params, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)


def test_mixed_dtypes_in_one_group_equal_separate_updates() -> None:
    together = [
        _params(torch.float32, sizes=(4097,))[0],
        _params(torch.bfloat16, sizes=(70_001,))[0],
        _params(torch.float16, sizes=(7,))[0],
    ]
    apart = [torch.nn.Parameter(p.detach().clone()) for p in together]
    grouped = DeepSpeedCPULion(together, lr=1e-2)
    singles = [DeepSpeedCPULion([p], lr=1e-2) for p in apart]
    for step in range(4):
        set_grads(step, together, apart)
        grouped.step()
        for optimizer in singles:
            optimizer.step()
    for joint, alone in zip(together, apart, strict=True):
        assert torch.equal(joint, alone)


def test_non_contiguous_parameter_is_updated_in_place() -> None:
    base = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    param = torch.nn.Parameter(base.t())  # a transposed view: not contiguous
    assert not param.is_contiguous()
    reference = torch.nn.Parameter(param.detach().clone())
    ours, ref = (
        DeepSpeedCPUAdam([param], lr=1e-2),
        torch.optim.AdamW([reference], lr=1e-2, weight_decay=0.0, foreach=False),
    )
    for step in range(5):
        set_grads(step, [param], [reference])
        ours.step()
        ref.step()
    torch.testing.assert_close(param, reference, rtol=1e-5, atol=1e-6)
    assert not param.is_contiguous()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": -1.0}, r"param_groups\[0\]: lr=-1.0 must be a finite number >= 0"),
        ({"betas": (1.0, 0.9)}, r"betas\[0\]=1.0 must be in \[0, 1\)"),
        ({"betas": (0.9,)}, r"betas=\(0.9,\) must be a pair"),
        ({"weight_decay": float("nan")}, "weight_decay=nan must be a finite number"),
    ],
)
def test_bad_hyper_parameters_name_the_argument(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(2))], **kwargs)


def test_bad_param_group_is_not_added() -> None:
    optimizer = DeepSpeedCPULion([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match=r"DeepSpeedCPULion param_groups\[1\]: lr=-0.5"):
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))], "lr": -0.5})
    assert len(optimizer.param_groups) == 1


def test_non_cpu_parameter_is_rejected_with_the_fix() -> None:
    param = torch.nn.Parameter(torch.empty(4, device="meta"))
    with pytest.raises(
        ValueError,
        match=r"param_groups\[0\]\['params'\]\[0\] is on meta; it updates CPU "
        r"tensors only.*'offload_optimizer'",
    ):
        DeepSpeedCPUAdam([param])


def test_unsupported_dtype_is_rejected() -> None:
    with pytest.raises(TypeError, match=r"has dtype torch.float64; supported dtypes are torch.float32"):
        DeepSpeedCPUAdagrad([torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))])
