"""MoE through `initialize()` at ZeRO stages 0, 1 and 2 on 2 and 4 gloo ranks, ep_size 1, 2 and 4.

fp16/bf16 at stage 0 are checked against ZeRO stage 1 in the same precision (itself checked here in fp32
against the all-experts reference): the same masters, norms and weights.

Each rank trains on its own batches; 20 steps of losses and the final weights (each rank's experts
compared with the same global experts) must equal one process that holds every expert and steps AdamW
on the mean of all ranks' losses. Expert gradients are summed over the expert-data-parallel group and
divided by the data-parallel world, the clipping norm counts every expert once.

Needs ds-parallel (the `ds-engine[all]` session); skipped without it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ds_comm.testing import run_ranks

pytest.importorskip("ds_parallel", reason="MoE needs ds-parallel: pip install 'ds-engine[parallel]'")

STEPS, LR = 20, 1e-2


def _train(rank: int, world: int, ep_size: int, stage: int, clip: float, client: bool = False) -> dict[str, Any]:
    from moe_cases import TinyMoE, batch, config, global_name, load_full_into, reference_run

    import ds_engine as deepspeed
    from ds_parallel.moe import split_params_into_different_moe_groups_for_optimizer

    full, ref_losses = reference_run(world, STEPS, LR, clip)
    torch.manual_seed(0)
    initial_full = TinyMoE(ep_size=1)
    model = TinyMoE(ep_size=ep_size)
    ep_rank = rank % ep_size
    load_full_into(model, initial_full, ep_rank, 4 // ep_size)
    cfg = config(stage, clip, LR)
    optimizer = None
    if client:  # the client builds DeepSpeed's MoE param groups itself
        cfg.pop("optimizer")
        groups = split_params_into_different_moe_groups_for_optimizer(
            {"params": list(model.parameters()), "name": "all"}
        )
        optimizer = torch.optim.AdamW(groups, lr=LR, weight_decay=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    loss_err = 0.0
    for step in range(STEPS):
        loss = engine(*batch(rank, step))
        engine.backward(loss)
        engine.step()
        loss_err = max(loss_err, abs(float(loss) - ref_losses[step][rank]))
    ref = dict(full.named_parameters())
    param_err = max(
        float((p.detach() - ref[global_name(n, ep_rank, 4 // ep_size)].detach()).abs().max())
        for n, p in engine.module.named_parameters()
    )
    return {
        "loss": loss_err,
        "param": param_err,
        "has_moe": engine.has_moe_layers,
        "num_experts": engine.num_experts,
        "norm": engine.get_global_grad_norm(),
    }


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("world", "ep_size", "stage", "clip"),
    # every stage, clipping on and off, expert-parallel sizes 1, 2 and 4, expert data-parallel groups of 1 and 2
    [
        (2, 2, 0, 0.3),
        (2, 1, 2, 0.3),
        (4, 2, 1, 0.0),
        (4, 2, 2, 0.3),
        (4, 4, 2, 0.0),
    ],
)
def test_moe_training_matches_all_experts_on_one_rank(world: int, ep_size: int, stage: int, clip: float) -> None:
    _check(run_ranks(world, _train, ep_size, stage, clip, timeout_s=540), clip)


@pytest.mark.timeout(600)
def test_client_optimizer_over_moe_param_groups() -> None:
    _check(run_ranks(2, _train, 2, 2, 0.3, True, timeout_s=540), 0.3)


def _check(results: list[dict[str, Any]], clip: float) -> None:
    for r in results:
        assert r["has_moe"] and r["num_experts"] == [4, 4]
        assert r["loss"] <= 1e-6, r
        assert r["param"] <= 1e-6, r
        if clip:
            assert r["norm"] is not None and r["norm"] > clip  # clipping was active


def _mixed_groups(rank: int, world: int) -> str:
    from moe_cases import TinyMoE, config

    import ds_engine as deepspeed

    model = TinyMoE(ep_size=2)
    cfg = config(1, 0.0, LR)
    cfg.pop("optimizer")
    try:
        deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=LR), config=cfg)
    except ValueError as err:
        return str(err)
    return "no error"


def test_zero_refuses_a_client_optimizer_mixing_experts_and_dense_params() -> None:
    msg = run_ranks(2, _mixed_groups, timeout_s=120)[0]
    assert "mixes expert parameters with dense ones" in msg
    assert "split_params_into_different_moe_groups_for_optimizer" in msg


def _zero3(rank: int, world: int) -> str:
    from moe_cases import TinyMoE, config

    import ds_engine as deepspeed

    try:
        deepspeed.initialize(model=TinyMoE(ep_size=2), config=config(3, 0.0, LR))
    except Exception as err:  # noqa: BLE001 - the message is what is checked
        return f"{type(err).__name__}: {err}"
    return "no error"


def test_zero3_with_moe_is_refused_by_name() -> None:
    msg = run_ranks(2, _zero3, timeout_s=120)[0]
    assert "zero_optimization.stage=3" in msg and "MoE" in msg
    assert "Native DeepSpeed MoE is not supported with ZeRO Stage 3" in msg  # DeepSpeed's words, its tests match


def _accessors(rank: int, world: int, stage: int) -> dict[str, float]:
    from moe_cases import TinyMoE, batch, config, global_name

    import ds_engine as deepspeed
    from ds_engine.utils import safe_get_full_fp32_param, safe_get_full_grad

    torch.manual_seed(0)
    full = TinyMoE(ep_size=1)
    (sum(full(*batch(r, 0)) for r in range(world)) / world).backward()
    ref = dict(full.named_parameters())
    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=TinyMoE(ep_size=2), config=config(stage, 0.0, LR))
    engine.backward(engine(*batch(rank, 0)))
    grad_err = value_err = 0.0
    for name, p in engine.module.named_parameters():
        want = ref[global_name(name, rank % 2, 2)]
        grad_err = max(grad_err, float((safe_get_full_grad(p) - want.grad).abs().max()))
        value_err = max(value_err, float((safe_get_full_fp32_param(p) - want.detach()).abs().max()))
    engine.step()
    return {"grad": grad_err, "value": value_err}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_accessors_see_expert_parameters_over_their_own_group(stage: int) -> None:
    """On 4 ranks with ep_size 2 an expert is partitioned over 2 ranks: the accessors gather it there."""
    for r in run_ranks(4, _accessors, stage, timeout_s=240):
        assert r["grad"] <= 1e-6 and r["value"] == 0.0, r


def _half_precision(rank: int, world: int, precision: str) -> dict[str, Any]:
    from moe_cases import TinyMoE, batch, config, load_full_into

    import ds_engine as deepspeed

    runs = {}
    for stage in (0, 1):
        torch.manual_seed(0)
        initial_full = TinyMoE(ep_size=1)
        model = TinyMoE(ep_size=2)
        load_full_into(model, initial_full, rank % 2, 2)
        cfg = config(stage, 0.3, LR)
        cfg[precision] = {"enabled": True, "initial_scale_power": 8} if precision == "fp16" else {"enabled": True}
        if precision == "bf16":  # fp32 accumulation at stage 0 (DeepSpeed's BF16_Optimizer), as ZeRO-1 keeps it
            cfg["data_types"] = {"grad_accum_dtype": "fp32"}
        engine, *_ = deepspeed.initialize(model=model, config=cfg)
        norms = []
        for step in range(8):
            engine.backward(engine(*batch(rank, step)))
            engine.step()
            norms.append(engine.get_global_grad_norm())
        weights = torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])
        runs[stage] = (norms, weights)
    return {"norms": (runs[0][0], runs[1][0]), "weight_err": float((runs[0][1] - runs[1][1]).abs().max())}


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("precision", "norm_rtol", "weight_atol"), [("bf16", 1e-5, 1e-6), ("fp16", 1e-4, 2e-3)])
def test_half_precision_at_stage0_trains_as_zero1(precision: str, norm_rtol: float, weight_atol: float) -> None:
    """4 ranks, ep_size 2: dense gradients averaged over 4 ranks, experts over their pair, the norm (clipping is
    active) spanning both experts' holders. bf16 matches ZeRO-1 exactly (measured 0.0); fp16 within one fp16 ulp."""
    for r in run_ranks(4, _half_precision, precision, timeout_s=540):
        stage0, stage1 = r["norms"]
        assert all(n is not None and n > 0.3 for n in stage0[:3]), stage0  # clipping was active
        torch.testing.assert_close(torch.tensor(stage0), torch.tensor(stage1), rtol=norm_rtol, atol=0)
        assert r["weight_err"] <= weight_atol, r


def _moe_is_the_model(rank: int, world: int) -> tuple[float, float]:
    import ds_engine as deepspeed
    from ds_parallel.moe import MoE

    torch.manual_seed(0)
    model = MoE(8, torch.nn.Linear(8, 8), num_experts=2, ep_size=2, k=1, min_capacity=0)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config={"train_micro_batch_size_per_gpu": 1}
    )
    x = torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    out, l_aux, _ = engine(x)
    engine.backward(out.sum() + l_aux)
    engine.step()
    return float(x.grad.abs().sum()), float(out.abs().sum())


def test_a_model_that_is_one_moe_layer_gets_its_expert_group() -> None:
    """The root module is the MoE layer itself: initialize() sets its expert-parallel group (the forward's
    exchange needs it), as for layers inside a model."""
    for grad_sum, out_sum in run_ranks(2, _moe_is_the_model, timeout_s=120):
        assert grad_sum > 0 and out_sum > 0


def _two_ep_sizes(rank: int, world: int) -> str:
    import ds_engine as deepspeed
    from ds_parallel.moe import MoE

    model = torch.nn.ModuleList([MoE(8, torch.nn.Linear(8, 8), num_experts=2, ep_size=e, k=1) for e in (1, 2)])
    try:
        deepspeed.initialize(
            model=model,
            config={
                "train_micro_batch_size_per_gpu": 1,
                "bf16": {"enabled": True},
                "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            },
        )
    except ValueError as err:
        return str(err)
    return "no error"


def test_half_precision_stage0_refuses_two_expert_parallel_sizes_by_name() -> None:
    msg = run_ranks(2, _two_ep_sizes, timeout_s=120)[0]
    assert "ep_size_1, ep_size_2" in msg and "ZeRO stage 1 or 2" in msg


def _grads_after_backward(rank: int, world: int, ep_size: int) -> float:
    from moe_cases import TinyMoE, batch, config, global_name, load_full_into

    import ds_engine as deepspeed

    torch.manual_seed(0)
    full = TinyMoE(ep_size=1)
    model = TinyMoE(ep_size=ep_size)
    load_full_into(model, full, rank % ep_size, 4 // ep_size)
    engine, *_ = deepspeed.initialize(model=model, config=config(0, 0.0, LR))
    engine.backward(engine(*batch(rank, 0)))  # the window's boundary: reduced here, before step()
    (sum(full(*batch(r, 0)) for r in range(world)) / world).backward()  # the mean loss on one process
    ref = dict(full.named_parameters())
    return max(
        float((p.grad - ref[global_name(n, rank % ep_size, 4 // ep_size)].grad).abs().max())
        for n, p in engine.module.named_parameters()
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ep_size", [1, 2])
def test_stage0_gradients_are_reduced_when_backward_returns(ep_size: int) -> None:
    """DeepSpeed reduces stage-0 gradients in the boundary backward; a read before step() sees the averaged
    dense and expert gradients (expert ones summed over the expert-data-parallel group, / data-parallel size)."""
    for err in run_ranks(2, _grads_after_backward, ep_size, timeout_s=240):
        assert err < 1e-6, err
