"""`_get_norm_groups()` and `_global_grad_norm` of the ZeRO optimizers on 2 ranks, against plain torch.

After backward, each stage (1, 2, 3; with and without `offload_optimizer`; fp32, with and without a static
loss scale) reports one norm per param group equal to the norm of that group's full gradient from a plain
torch model on both ranks' batches (averaged, as the reduction averages), times the loss scale (the
gradients are measured as held, before the step unscales them). A clamp of the gradients through
DeepSpeed's accessors (stage 3: `set_local_grad_for_param`, what `safe_set_local_grad` calls; stages
1/2: `set_fp32_grad_for_param`) shows in the next reading, the step's `_global_grad_norm` is the norm of
those norms over the loss scale, and the step applies the clamped gradients as plain AdamW does.
Tolerances: 1e-5 relative on norms (fp32 sums in another order), 1e-5 absolute on parameters.
"""

from __future__ import annotations

from typing import Any

import torch
from zero_dist_cases import batch, flat_params, loss_fn, make_model, param_groups, zero_config

import ds_zero
from ds_comm.testing import run_ranks
from ds_ops.precision import LossScaler

CLAMP = 0.02  # on the unscaled gradient (times the loss scale on the held one)
CASES = [(1, "none", 1.0), (1, "cpu", 1.0), (2, "none", 1.0), (2, "cpu", 8.0), (3, "none", 8.0), (3, "cpu", 1.0)]


def _trained_groups(model: torch.nn.Module) -> list[list[torch.Tensor]]:
    return [[p for p in g["params"] if p.requires_grad] for g in param_groups(model)]


def _reference(world: int) -> dict[str, Any]:
    """Plain torch: the averaged gradient's group norms, those after the clamp, and two AdamW steps."""
    model = make_model()
    opt = torch.optim.AdamW(param_groups(model), betas=(0.9, 0.99), foreach=False)
    groups = _trained_groups(model)
    out: dict[str, Any] = {}
    for step in range(2):
        opt.zero_grad()
        for r in range(world):
            (loss_fn(model, *batch(step, 0, r, world)) / world).backward()
        if step == 0:
            out["norms"] = [torch.cat([p.grad.reshape(-1) for p in g]).norm() for g in groups]
            for g in groups:
                for p in g:
                    p.grad.clamp_(-CLAMP, CLAMP)
            out["clamped"] = [torch.cat([p.grad.reshape(-1) for p in g]).norm() for g in groups]
        opt.step()
    out["params"] = flat_params(model)
    return out


def _clamp_through_accessors(opt: Any, stage: int, model: torch.nn.Module, scale: float) -> None:
    bound = CLAMP * scale
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if stage == 3:
            local = opt.get_local_fp32_grad_for_param(p)
            opt.set_local_grad_for_param(local.clamp(-bound, bound), p)
        else:
            opt.set_fp32_grad_for_param(opt.get_fp32_grad_for_param(p).clamp(-bound, bound), p)


def _case(rank: int, world: int, stage: int, device: str, scale: float) -> dict[str, Any]:
    model = make_model()
    base = torch.optim.AdamW(param_groups(model), betas=(0.9, 0.99), foreach=False)
    kwargs: dict[str, Any] = {"loss_scaler": LossScaler(scale), "clip_grad": 100.0}  # clip: the norm is taken
    if stage == 3:
        config = zero_config(3, offload_optimizer={"device": device}, param_persistence_threshold=0)
        opt: Any = ds_zero.DeepSpeedZeroOptimizer_Stage3(model, base, config=config, **kwargs)
    else:
        config = zero_config(stage, offload_optimizer={"device": device})
        opt = ds_zero.DeepSpeedZeroOptimizer(base, config=config, module=model, **kwargs)
    out: dict[str, Any] = {}
    opt.backward(loss_fn(model, *batch(0, 0, rank, world)))
    out["norms"] = opt._get_norm_groups()
    out["again"] = opt._get_norm_groups()  # reading twice changes nothing (stage 1 reduces once)
    if stage == 1:
        try:
            opt.backward(loss_fn(model, *batch(0, 0, rank, world)))
            out["backward_after_reduce"] = None
        except ValueError as err:
            out["backward_after_reduce"] = str(err)
    _clamp_through_accessors(opt, stage, model, scale)
    out["clamped"] = opt._get_norm_groups()
    assert opt.step()
    out["global"] = opt._global_grad_norm
    opt.zero_grad()
    opt.backward(loss_fn(model, *batch(1, 0, rank, world)))  # a plain second step: the window was reset
    assert opt.step()
    if stage == 3:
        with ds_zero.GatheredParameters(list(model.parameters())):
            out["params"] = flat_params(model)
    else:
        out["params"] = flat_params(model)
    return out


def _all_cases(rank: int, world: int) -> dict[tuple[int, str, float], dict[str, Any]]:
    return {case: _case(rank, world, *case) for case in CASES}


def test_norm_groups_match_plain_torch_and_follow_gradient_edits() -> None:
    ref = _reference(2)
    for rank, results in enumerate(run_ranks(2, _all_cases, timeout_s=240)):
        for (stage, device, scale), out in results.items():
            where = f"rank {rank} stage {stage} offload {device} scale {scale}"
            assert len(out["norms"]) == 2 and all(n.dim() == 0 for n in out["norms"]), where
            for key in ("norms", "again"):
                expected = torch.stack(ref["norms"]) * scale
                torch.testing.assert_close(torch.stack(out[key]), expected, rtol=1e-5, atol=1e-7, msg=where)
            clamped = torch.stack(ref["clamped"])
            assert bool((clamped < torch.stack(ref["norms"])).all()), "the clamp must change both groups"
            torch.testing.assert_close(torch.stack(out["clamped"]), clamped * scale, rtol=1e-5, atol=1e-7, msg=where)
            expected_global = float(torch.stack(out["clamped"]).norm()) / scale
            assert abs(out["global"] - expected_global) <= 1e-5 * expected_global, where
            torch.testing.assert_close(out["params"], ref["params"], rtol=0, atol=1e-5, msg=where)
            if stage == 1:
                assert "call step() or zero_grad() before the next backward" in out["backward_after_reduce"], where
