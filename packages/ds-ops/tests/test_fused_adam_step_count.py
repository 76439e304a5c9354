"""FusedAdam's per-parameter step count: stepping a group one tensor at a time (as ZeRO-3 does with its
tiles), partial steps, and resuming from the state layouts other Adams save.

Every case is checked against torch.optim.AdamW / Adam (foreach=False) on the same gradients, fp32,
to rtol=1e-5, atol=1e-6 (fp32 math in torch's order without FMA; torch's lerp uses FMA).
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from _optim_cases import set_grads

from ds_ops import DeepSpeedCPUAdam, FusedAdam

TOL = {"rtol": 1e-5, "atol": 1e-6}
SIZES = (5, 4097, 33)


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=generator)) for n in SIZES]


def _clone(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def _roundtrip(state_dict: dict[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer)


def _assert_same(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
    for mine, ref in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine.detach(), ref.detach(), **TOL)


def test_stepping_one_tensor_at_a_time_counts_each_once() -> None:
    """ZeRO-3 narrows the group to one tile and steps, tile after tile: each tensor must advance once."""
    params = _params()
    ref_params = _clone(params)
    ours = FusedAdam(params, lr=1e-2, weight_decay=0.1)
    reference = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1, foreach=False)
    group = ours.param_groups[0]
    for step in range(12):
        set_grads(step, params, ref_params)
        for tile in params:
            group["params"] = [tile]
            ours.step()
        group["params"] = params
        reference.step()
    _assert_same(params, ref_params)
    assert [ours.state[p]["step"] for p in params] == [12, 12, 12]


def test_parameters_at_different_counts_step_with_their_own() -> None:
    """A parameter without a gradient skips the step; afterwards each one's bias correction is its own."""
    params = _params(1)
    ref_params = _clone(params)
    ours = FusedAdam(params, lr=1e-2, adam_w_mode=False, weight_decay=0.01)
    reference = torch.optim.Adam(ref_params, lr=1e-2, weight_decay=0.01, foreach=False)
    for step in range(10):
        set_grads(step, params, ref_params)
        if step % 3 == 0:
            params[1].grad = ref_params[1].grad = None
        ours.step()
        reference.step()
    _assert_same(params, ref_params)
    assert [ours.state[p]["step"] for p in params] == [10, 6, 10]


def _resume_against_torch(first: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int) -> None:
    """Run `first` for `steps`, load its state into a FusedAdam and go on; all of it must match torch AdamW."""
    ref_params = _clone(params)
    reference = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.05, foreach=False)
    for step in range(steps):
        set_grads(step, params, ref_params)
        first.step()
        reference.step()
    saved = _roundtrip(first.state_dict())
    resumed_params = _clone(params)
    resumed = FusedAdam(resumed_params, lr=1e-2, weight_decay=0.05)
    resumed.load_state_dict(saved)
    for step in range(steps, 2 * steps):
        set_grads(step, resumed_params, ref_params)
        resumed.step()
        reference.step()
    _assert_same(resumed_params, ref_params)
    assert [resumed.state[p]["step"] for p in resumed_params] == [2 * steps] * len(SIZES)


def test_resumes_from_a_deepspeed_cpu_adam_state() -> None:
    params = _params(2)
    _resume_against_torch(DeepSpeedCPUAdam(params, lr=1e-2, weight_decay=0.05, adamw_mode=True), params, 7)


def test_resumes_from_a_torch_adamw_state() -> None:
    params = _params(3)
    _resume_against_torch(torch.optim.AdamW(params, lr=1e-2, weight_decay=0.05, foreach=False), params, 7)


def test_resumes_from_a_state_that_counts_per_group() -> None:
    """ds's FusedAdam before the per-parameter count saved `group["step"]` and moments only."""
    params = _params(4)
    first = FusedAdam(params, lr=1e-2, weight_decay=0.05)
    ref_params = _clone(params)
    reference = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.05, foreach=False)
    for step in range(5):
        set_grads(step, params, ref_params)
        first.step()
        reference.step()
    saved = _roundtrip(first.state_dict())
    for state in saved["state"].values():
        del state["step"]
    saved["param_groups"][0]["step"] = 5
    resumed_params = _clone(params)
    resumed = FusedAdam(resumed_params, lr=1e-2, weight_decay=0.05)
    resumed.load_state_dict(saved)
    for step in range(5, 10):
        set_grads(step, resumed_params, ref_params)
        resumed.step()
        reference.step()
    _assert_same(resumed_params, ref_params)


@pytest.mark.parametrize("fused_first", [True, False], ids=["fused_to_cpu_adam", "cpu_adam_to_fused"])
def test_state_dicts_cross_between_fused_and_cpu_adam(fused_first: bool) -> None:
    """A run can resume with offload on (DeepSpeedCPUAdam) from a save without (FusedAdam), and back."""
    params = _params(5)
    ref_params = _clone(params)
    reference = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.0, foreach=False)

    def fused(ps: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return FusedAdam(ps, lr=1e-2)

    def cpu_adam(ps: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return DeepSpeedCPUAdam(ps, lr=1e-2, weight_decay=0.0, adamw_mode=True)

    make_first, make_second = (fused, cpu_adam) if fused_first else (cpu_adam, fused)
    first = make_first(params)
    for step in range(4):
        set_grads(step, params, ref_params)
        first.step()
        reference.step()
    second_params = _clone(params)
    second = make_second(second_params)
    second.load_state_dict(_roundtrip(first.state_dict()))
    for step in range(4, 8):
        set_grads(step, second_params, ref_params)
        second.step()
        reference.step()
    _assert_same(second_params, ref_params)


def test_a_refused_step_leaves_every_count_as_it_was() -> None:
    good, bad = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(3))
    optimizer = FusedAdam([good, bad], lr=1e-2)
    good.grad, bad.grad = torch.ones(4), torch.ones(3)
    optimizer.step()
    bad.grad_dtype = None  # torch refuses a gradient of another dtype unless told to accept one
    bad.grad = torch.ones(3, dtype=torch.bfloat16)
    before = good.detach().clone()
    with pytest.raises(TypeError, match="gradient dtype torch.bfloat16 differs"):
        optimizer.step()
    assert [optimizer.state[p]["step"] for p in (good, bad)] == [1, 1]
    assert torch.equal(good.detach(), before)


def test_reloaded_param_groups_keep_the_saved_keys() -> None:
    """Loading a FusedAdam state dict leaves each group with the keys it was saved with (torch's loader
    adds `differentiable` to `defaults`; copying that into the groups made a reload differ from the save)."""
    first = FusedAdam(_params(2), lr=1e-2)
    saved = _roundtrip(first.state_dict())
    second = FusedAdam(_params(2), lr=1e-3)
    second.load_state_dict(saved)
    reloaded = second.state_dict()["param_groups"]
    assert [sorted(g) for g in reloaded] == [sorted(g) for g in saved["param_groups"]]
    assert reloaded[0]["lr"] == 1e-2
    second.add_param_group({"params": _params(1)})
    assert sorted(second.param_groups[-1]) == sorted(first.param_groups[0])
