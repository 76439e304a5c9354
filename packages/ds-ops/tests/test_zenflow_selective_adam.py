"""ZenFlowSelectiveAdamW (ZeRO stage 1/2 layout) against torch.optim.AdamW run on the selected columns alone.

Same data on both sides: the reference is a plain `torch.optim.AdamW` over a parameter holding only the
selected columns, fed the same column gradients. Tolerance: 1e-6 absolute / 1e-5 relative in fp32
(the arithmetic is AdamW's, in its order; the bound leaves room for a different fused kernel inside
torch). Columns that are not selected must stay bit-identical.
"""

from __future__ import annotations

import pytest
import torch

from ds_ops import ZenFlowSelectiveAdamW

ATOL, RTOL = 1e-6, 1e-5


def _selective_run(
    weight: torch.Tensor,
    selected: torch.Tensor,
    grads: list[torch.Tensor],
    *,
    offload: bool = False,
    bucket_size: float = 5e8,
    **adamw: object,
) -> tuple[torch.nn.Parameter, ZenFlowSelectiveAdamW]:
    param = torch.nn.Parameter(weight.clone())
    opt = ZenFlowSelectiveAdamW([param], offload=offload, bucket_size=bucket_size, **adamw)
    for grad in grads:
        param.selected_indices = selected
        param.selected_grad = grad[:, selected].clone() if weight.dim() > 1 else grad.clone()
        opt.step()
    return param, opt


def _reference_run(
    weight: torch.Tensor, selected: torch.Tensor, grads: list[torch.Tensor], **adamw: object
) -> torch.Tensor:
    cols = torch.nn.Parameter(weight[:, selected].clone() if weight.dim() > 1 else weight.clone())
    ref = torch.optim.AdamW([cols], **adamw)
    for grad in grads:
        cols.grad = grad[:, selected].clone() if weight.dim() > 1 else grad.clone()
        ref.step()
    return cols.detach()


@pytest.mark.parametrize(
    "adamw",
    [
        {"lr": 1e-2},
        {"lr": 3e-3, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1},
        {"lr": 1e-2, "weight_decay": 0.0, "amsgrad": True},
        {"lr": 5e-3, "maximize": True},
    ],
    ids=["defaults", "custom", "amsgrad", "maximize"],
)
def test_selected_columns_match_adamw_on_those_columns(adamw: dict) -> None:
    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(7, 12, generator=gen)
    selected = torch.tensor([2, 5, 6, 11])
    grads = [torch.randn(7, 12, generator=gen) for _ in range(8)]

    param, opt = _selective_run(weight, selected, grads, **adamw)
    expected = _reference_run(weight, selected, grads, **adamw)

    torch.testing.assert_close(param.data[:, selected], expected, atol=ATOL, rtol=RTOL)
    others = torch.ones(12, dtype=torch.bool)
    others[selected] = False
    assert torch.equal(param.data[:, others], weight[:, others]), "unselected columns changed"
    assert opt.state[param]["step"].item() == len(grads)
    assert opt.state[param]["exp_avg"].shape == (7, 4)


def test_one_dimensional_parameter_is_updated_whole() -> None:
    gen = torch.Generator().manual_seed(3)
    bias = torch.randn(9, generator=gen)
    grads = [torch.randn(9, generator=gen) for _ in range(5)]
    param, _ = _selective_run(bias, torch.arange(9), grads, lr=1e-2)
    torch.testing.assert_close(param.data, _reference_run(bias, torch.arange(9), grads, lr=1e-2), atol=ATOL, rtol=RTOL)


def test_offloaded_moments_give_the_same_result_in_small_buckets() -> None:
    gen = torch.Generator().manual_seed(5)
    weights = [torch.randn(4, 10, generator=gen) for _ in range(3)]
    selected = [torch.tensor([0, 3]), torch.tensor([1, 2, 9]), torch.tensor([4])]
    steps = [[torch.randn(4, 10, generator=gen) for _ in weights] for _ in range(4)]

    runs = {}
    for offload in (False, True):
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        # bucket_size=5: every bucket closes after its first or second parameter.
        opt = ZenFlowSelectiveAdamW(params, lr=1e-2, offload=offload, bucket_size=5)
        for grads in steps:
            for p, sel, g in zip(params, selected, grads, strict=True):
                p.selected_indices = sel
                p.selected_grad = g[:, sel].clone()
            opt.step()
        runs[offload] = (params, opt)

    (plain, plain_opt), (off, off_opt) = runs[False], runs[True]
    for p, q in zip(plain, off, strict=True):
        assert torch.equal(p.data, q.data)
        assert torch.equal(plain_opt.state[p]["exp_avg"], q.exp_avg_cpu_data)
        assert torch.equal(plain_opt.state[p]["exp_avg_sq"], q.exp_avg_sq_cpu_data)
        assert q.exp_avg is None and q.exp_avg_sq is None, "device copies of the moments were kept"
        assert "exp_avg" not in off_opt.state[q], "offloaded moments also kept in the optimizer state"
        assert off_opt.state[q]["step"].item() == len(steps)


def test_snapshot_is_restored_before_the_update() -> None:
    gen = torch.Generator().manual_seed(8)
    weight = torch.randn(5, 6, generator=gen)
    selected = torch.tensor([1, 4])
    grad = torch.randn(5, 6, generator=gen)

    param = torch.nn.Parameter(weight.clone())
    opt = ZenFlowSelectiveAdamW([param], lr=1e-2)
    param.selected_indices = selected
    param.selected_grad = grad[:, selected].clone()
    opt.temp_copy_param({0: [param]})
    assert torch.equal(param.temp_selected_param, weight[:, selected])
    param.data.add_(100.0)  # e.g. the CPU optimizer rewrote every column in between
    opt.step()

    expected = _reference_run(weight, selected, [grad], lr=1e-2)
    torch.testing.assert_close(param.data[:, selected], expected, atol=ATOL, rtol=RTOL)
    assert param.temp_selected_param is None and param.selected_grad is None


def test_snapshot_goes_to_the_host_with_offload() -> None:
    param = torch.nn.Parameter(torch.randn(3, 4))
    param.selected_indices = torch.tensor([0, 2])
    param.selected_grad = torch.randn(3, 2)
    opt = ZenFlowSelectiveAdamW([param], offload=True)
    opt.temp_copy_param({0: [param]})
    assert param.temp_selected_param.device.type == "cpu"
    assert param.temp_selected_param.data_ptr() != param.data.data_ptr()


def test_group_step_updates_now_and_leaves_the_snapshot() -> None:
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(3, 5, generator=gen)
    grad = torch.randn(3, 5, generator=gen)
    selected = torch.tensor([0, 4])
    first, second = torch.nn.Parameter(weight.clone()), torch.nn.Parameter(weight.clone())
    opt = ZenFlowSelectiveAdamW([{"params": [first]}, {"params": [second], "lr": 0.5}], lr=1e-2)
    for p in (first, second):
        p.selected_indices = selected
        p.selected_grad = grad[:, selected].clone()
        p.temp_selected_param = torch.zeros(3, 2)
    opt.group_step({1: [second]})
    torch.testing.assert_close(second.data[:, selected], _reference_run(weight, selected, [grad], lr=0.5))
    assert second.selected_grad is None
    assert second.temp_selected_param is not None, "group_step applies no snapshot and keeps it"
    assert torch.equal(first.data, weight) and first.selected_grad is not None


def test_parameters_without_a_selected_gradient_are_left_alone() -> None:
    a, b = torch.nn.Parameter(torch.randn(2, 3)), torch.nn.Parameter(torch.randn(2, 3))
    before = b.data.clone()
    opt = ZenFlowSelectiveAdamW([a, b])
    a.selected_indices = torch.tensor([1])
    a.selected_grad = torch.randn(2, 1)
    opt.step()
    opt.step()  # a's gradient was consumed: nothing to do, no error
    assert torch.equal(b.data, before)
    assert b not in opt.state
    assert opt.state[a]["step"].item() == 1


def test_clear_selected_mv_zeroes_moments_and_keeps_the_step_count() -> None:
    param = torch.nn.Parameter(torch.randn(4, 6))
    opt = ZenFlowSelectiveAdamW([param], lr=1e-2, betas=(0.9, 0.99))
    for _ in range(3):
        param.selected_indices = torch.tensor([1, 3])
        param.selected_grad = torch.randn(4, 2)
        opt.step()
    opt.clear_selected_mv()
    state = opt.state[param]
    assert not state["exp_avg"].any() and not state["exp_avg_sq"].any()
    assert state["step"].item() == 3

    grad = torch.randn(4, 2)
    param.selected_indices = torch.tensor([0, 5])  # a new selection of the same size
    param.selected_grad = grad.clone()
    opt.step()
    torch.testing.assert_close(state["exp_avg"], 0.1 * grad)
    torch.testing.assert_close(state["exp_avg_sq"], 0.01 * grad * grad)
    assert state["step"].item() == 4


def test_clear_selected_mv_with_offload_zeroes_the_host_moments() -> None:
    param = torch.nn.Parameter(torch.randn(4, 6))
    opt = ZenFlowSelectiveAdamW([param], offload=True)
    param.selected_indices = torch.tensor([2])
    param.selected_grad = torch.randn(4, 1)
    opt.step()
    assert param.exp_avg_cpu_data.any()
    opt.clear_selected_mv()
    assert not param.exp_avg_cpu_data.any() and not param.exp_avg_sq_cpu_data.any()


def test_half_precision_step_count_is_loaded_as_fp32() -> None:
    param = torch.nn.Parameter(torch.randn(2, 2))
    opt = ZenFlowSelectiveAdamW([param])
    param.selected_indices = torch.tensor([0])
    param.selected_grad = torch.randn(2, 1)
    opt.step()
    saved = opt.state_dict()
    saved["state"][0]["step"] = saved["state"][0]["step"].half()
    fresh = ZenFlowSelectiveAdamW([param])
    fresh.load_state_dict(saved)
    assert fresh.state[param]["step"].dtype == torch.float32
    assert fresh.step == fresh._step_without_offload


def test_works_under_an_lr_scheduler() -> None:
    param = torch.nn.Parameter(torch.randn(3, 3))
    opt = ZenFlowSelectiveAdamW([param], lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        param.selected_indices = torch.tensor([1])
        param.selected_grad = torch.randn(3, 1)
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == 0.25
    assert opt.state[param]["step"].item() == 2


def test_mismatched_gradient_shape_is_refused_by_name() -> None:
    param = torch.nn.Parameter(torch.randn(3, 5))
    before = param.data.clone()
    opt = ZenFlowSelectiveAdamW([param])
    param.selected_indices = torch.tensor([0, 1])
    param.selected_grad = torch.randn(3, 3)
    with pytest.raises(ValueError, match=r"selected_grad has shape \(3, 3\).*\(3, 2\)"):
        opt.step()
    assert torch.equal(param.data, before)


def test_a_selection_of_another_size_is_refused() -> None:
    param = torch.nn.Parameter(torch.randn(3, 5))
    opt = ZenFlowSelectiveAdamW([param])
    param.selected_indices = torch.tensor([0, 1])
    param.selected_grad = torch.randn(3, 2)
    opt.step()
    param.selected_indices = torch.tensor([0, 1, 2])
    param.selected_grad = torch.randn(3, 3)
    with pytest.raises(ValueError, match="'exp_avg' has shape \\(3, 2\\) but the selection now has shape \\(3, 3\\)"):
        opt.step()


def test_bucket_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="bucket_size must be positive, got 0"):
        ZenFlowSelectiveAdamW([torch.nn.Parameter(torch.randn(2))], offload=True, bucket_size=0)


def test_a_failure_mid_bucket_keeps_what_was_done_and_what_was_not() -> None:
    gen = torch.Generator().manual_seed(17)
    good, bad = (
        torch.nn.Parameter(torch.randn(3, 4, generator=gen)),
        torch.nn.Parameter(torch.randn(3, 4, generator=gen)),
    )
    bad_before = bad.data.clone()
    opt = ZenFlowSelectiveAdamW([good, bad], lr=1e-2, offload=True)  # one bucket for both
    grad = torch.randn(3, 4, generator=gen)
    good.selected_indices = bad.selected_indices = torch.tensor([1, 2])
    good.selected_grad = grad[:, [1, 2]].clone()
    bad.selected_grad = torch.randn(3, 3)
    with pytest.raises(ValueError, match="selected_grad has shape"):
        opt.step()
    torch.testing.assert_close(good.exp_avg_cpu_data, 0.1 * grad[:, [1, 2]])  # the update's moments were stored
    assert good.selected_grad is None and good.exp_avg is None, "the done update was not consumed"
    assert torch.equal(bad.data, bad_before) and bad.selected_grad is not None
