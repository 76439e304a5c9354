"""DeepSpeedCPUAdam.step_subgroup / rollback_subgroup (DeepSpeed's per-sub-group API for ZeRO-3 offload).

step_subgroup against torch.optim.Adam / AdamW: two sub-groups stepped alternately through one
optimizer (the way ZeRO-3 swaps each sub-group's flat partition into the param group), each equal
to its own torch optimizer within rtol=1e-5, atol=1e-6, with its own step count.

rollback_subgroup inverts the last step: after step then rollback, an fp32 parameter equals its value
before the step within rtol=1e-6, atol=1e-8 (a few ulps: the step rounded it, the inverse rounds once
more; observed 2.4e-7 on values up to 4.5); a moment within rtol=1e-5 and 4 ulps of its tensor's
largest value (it is restored by a subtraction, whose error scales with the operands); a bf16/fp16
parameter within one ulp of its dtype, since the step rounded it to that dtype.
"""

from __future__ import annotations

import pytest
import torch

from ds_ops import DeepSpeedCPUAdam

TOL = {"rtol": 1e-5, "atol": 1e-6}
ROLLBACK_TOL = {"rtol": 1e-6, "atol": 1e-8}


def _param(numel: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.randn(numel, generator=torch.Generator().manual_seed(seed)).to(dtype))


def _grad(numel: int, seed: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(10_000 + seed))


@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam_l2"])
def test_subgroups_step_like_torch_adam_each_with_its_own_state(adamw_mode: bool) -> None:
    sizes = {0: 4097, 1: 130}
    params = {sub: _param(n, sub) for sub, n in sizes.items()}
    refs = {sub: torch.nn.Parameter(p.detach().clone()) for sub, p in params.items()}
    reference_class = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    references = {sub: reference_class([q], lr=1e-3, weight_decay=0.05, foreach=False) for sub, q in refs.items()}
    ours = DeepSpeedCPUAdam([params[0]], lr=1e-3, weight_decay=0.05, adamw_mode=adamw_mode)
    for step in range(30):
        for sub in (0, 1) if step % 3 else (0,):  # sub-group 1 skips every third step
            grad = _grad(sizes[sub], step * 2 + sub)
            ours.param_groups[0]["params"] = [params[sub]]
            params[sub].grad, refs[sub].grad = grad, grad.clone()
            ours.step_subgroup(sub)
            references[sub].step()
            params[sub].grad = None
    for sub in sizes:
        torch.testing.assert_close(params[sub].detach(), refs[sub].detach(), **TOL)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(ours.state[sub][key], references[sub].state[refs[sub]][key], **TOL)
        assert ours.state[sub]["step"] == int(references[sub].state[refs[sub]]["step"])
    assert (ours.state[0]["step"], ours.state[1]["step"]) == (30, 20)
    assert params[0] not in ours.state  # the state lives under the sub-group id, not the parameter


def _moment_tol(expected: torch.Tensor) -> dict[str, float]:
    """A moment is restored by a subtraction, so its error scales with the tensor's largest value, not its own."""
    return {"rtol": 1e-5, "atol": 4 * 2**-23 * float(expected.abs().max())}


CASES = pytest.mark.parametrize(
    ("adamw_mode", "bias_correction", "weight_decay"),
    [(True, True, 0.1), (False, True, 0.1), (True, False, 0.0), (False, False, 0.0)],
    ids=["adamw", "adam_l2", "no_bias_correction", "adam_no_decay"],
)


@CASES
def test_rollback_restores_the_state_before_the_last_step(
    adamw_mode: bool, bias_correction: bool, weight_decay: float
) -> None:
    param = _param(4097, 0)
    ours = DeepSpeedCPUAdam(
        [param], lr=1e-2, weight_decay=weight_decay, adamw_mode=adamw_mode, bias_correction=bias_correction
    )
    for step in range(4):
        param.grad = _grad(4097, step)
        ours.step_subgroup(7)
    state = ours.state[7]
    before = [param.detach().clone(), state["exp_avg"].clone(), state["exp_avg_sq"].clone()]
    param.grad = _grad(4097, 4)
    ours.step_subgroup(7)
    after = [param.detach().clone(), state["exp_avg"].clone(), state["exp_avg_sq"].clone()]
    ours.rollback_subgroup(7)  # .grad still holds the step's gradient
    assert state["step"] == 4
    torch.testing.assert_close(param.detach(), before[0], **ROLLBACK_TOL)
    torch.testing.assert_close(state["exp_avg"], before[1], **_moment_tol(before[1]))
    torch.testing.assert_close(state["exp_avg_sq"], before[2], **_moment_tol(before[2]))
    ours.step_subgroup(7)  # the same step again lands where it did
    assert state["step"] == 5
    torch.testing.assert_close(param.detach(), after[0], **ROLLBACK_TOL)
    torch.testing.assert_close(state["exp_avg"], after[1], **_moment_tol(after[1]))
    torch.testing.assert_close(state["exp_avg_sq"], after[2], **_moment_tol(after[2]))


@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam_l2"])
def test_retracted_steps_leave_torch_adams_trajectory(adamw_mode: bool) -> None:
    """ZeRO's pattern: every third step is retracted (as after an overflow); torch never sees those gradients."""
    param = _param(4097, 1)
    ref = torch.nn.Parameter(param.detach().clone())
    ours = DeepSpeedCPUAdam([param], lr=1e-3, weight_decay=0.01, adamw_mode=adamw_mode)
    reference = (torch.optim.AdamW if adamw_mode else torch.optim.Adam)([ref], lr=1e-3, weight_decay=0.01)
    for step in range(30):
        param.grad = _grad(4097, step)
        ours.step_subgroup(0)
        if step % 3 == 2:
            ours.rollback_subgroup(0)
            continue
        ref.grad = param.grad.clone()
        reference.step()
    assert ours.state[0]["step"] == int(reference.state[ref]["step"]) == 20
    torch.testing.assert_close(param.detach(), ref.detach(), **TOL)
    for key in ("exp_avg", "exp_avg_sq"):
        expected = reference.state[ref][key]
        torch.testing.assert_close(ours.state[0][key], expected, **_moment_tol(expected))


def test_undoing_several_steps_returns_to_the_start() -> None:
    """Several rollbacks in a row, with gradients bounded away from 0 (see rollback_subgroup: a variance
    far below a later, larger one's rounding cannot be recovered, in DeepSpeed's rollback either)."""
    param = _param(1000, 2)
    start = param.detach().clone()
    ours = DeepSpeedCPUAdam([param], lr=1e-2, weight_decay=0.01)
    generator = torch.Generator().manual_seed(5)
    grads = [
        torch.sign(torch.randn(1000, generator=generator)) * (0.5 + torch.rand(1000, generator=generator))
        for _ in range(3)
    ]
    for grad in grads:
        param.grad = grad
        ours.step_subgroup(0)
    for step, grad in reversed(list(enumerate(grads))):
        param.grad = grad
        ours.rollback_subgroup(0)
        assert ours.state[0]["step"] == step
    torch.testing.assert_close(param.detach(), start, rtol=1e-5, atol=1e-6)
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(ours.state[0][key], torch.zeros(1000), rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_parameter_rollback_within_its_rounding(dtype: torch.dtype) -> None:
    param = _param(512, 2, dtype)
    ours = DeepSpeedCPUAdam([param], lr=1e-3)
    param.grad = _grad(512, 0).to(dtype)
    ours.step_subgroup(0)
    param.grad = _grad(512, 1).to(dtype)
    before = (param.detach().clone(), ours.state[0]["exp_avg"].clone(), ours.state[0]["exp_avg_sq"].clone())
    ours.step_subgroup(0)
    assert not torch.equal(param.detach(), before[0])
    ours.rollback_subgroup(0)
    ulp = 2**-7 if dtype == torch.bfloat16 else 2**-10
    torch.testing.assert_close(param.detach().float(), before[0].float(), rtol=ulp, atol=1e-5)
    assert ours.state[0]["exp_avg"].dtype == torch.float32  # fp32_optimizer_states=True (the default)
    # the moments are fp32, but the step's gradient (rounded) is what the inverse subtracts: fp32 tolerance
    torch.testing.assert_close(ours.state[0]["exp_avg"], before[1], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(ours.state[0]["exp_avg_sq"], before[2], rtol=1e-5, atol=1e-7)


def test_deepspeeds_errors_and_ours() -> None:
    param = _param(64, 3)
    ours = DeepSpeedCPUAdam([param])
    with pytest.raises(RuntimeError, match="Cannot rollback optimizer state for sub_group_id 0"):
        ours.rollback_subgroup(0)
    param.grad = _grad(64, 0)
    ours.step_subgroup(0)
    ours.rollback_subgroup(0)
    with pytest.raises(RuntimeError, match="Cannot rollback sub_group_id 0: step count is 0"):
        ours.rollback_subgroup(0)
    ours.step_subgroup(0)
    param.grad = None
    with pytest.raises(RuntimeError, match="needs the gradient of the step it undoes"):
        ours.rollback_subgroup(0)
    assert ours.state[0]["step"] == 1
    ours.step_subgroup(0)  # no gradient: nothing to do, as in DeepSpeed
    assert ours.state[0]["step"] == 1
    other = _param(64, 4)
    ours.add_param_group({"params": [other]})
    param.grad, other.grad = _grad(64, 1), _grad(64, 2)
    with pytest.raises(ValueError, match="2 parameters have gradients"):
        ours.step_subgroup(0)
    other.grad = None
    ours.param_groups[0]["params"] = [_param(65, 5)]
    ours.param_groups[0]["params"][0].grad = _grad(65, 3)
    with pytest.raises(ValueError, match="sub-group 0's exp_avg has 64 elements"):
        ours.step_subgroup(0)
    assert ours.state[0]["step"] == 1


def test_a_step_that_discarded_the_state_cannot_be_undone() -> None:
    param = _param(8, 6)
    ours = DeepSpeedCPUAdam([param], betas=(0.0, 0.999))
    param.grad = _grad(8, 0)
    ours.step_subgroup(0)
    with pytest.raises(ValueError, match="cannot undo a step with betas=\\(0.0, 0.999\\)"):
        ours.rollback_subgroup(0)
    assert ours.state[0]["step"] == 1
