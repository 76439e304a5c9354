"""bf16 master weights, gradients and optimizer states (`bf16_master_weights_and_gradients` +
`bf16_optimizer_states`) at ZeRO stages 1, 2 and 3, on 2 gloo ranks.

Reference: plain PyTorch doing the same math on one process: the bf16 model, each rank's bf16 gradients
averaged over the ranks (summed in fp32, halved, rounded to bf16), and `torch.optim.AdamW` (foreach=False)
whose parameters and moments are bf16. Tolerance: after 6 steps every parameter within 1 bf16 ulp
(relative 2**-7) of the reference plus an absolute 1e-6 floor; the losses within 1e-3. Both sides round
every element alike, so the difference seen is 0 (an fp32-master run misses this tolerance).

Model-state bytes per trained element of a rank's partition are measured from the tensors themselves:
master + gradient partition + Adam's two moments = 2 + 2 + 2 + 2 = 8 with bf16 masters, 4 + 4 + 4 + 4 = 16
with fp32 masters over the same bf16 model.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from stage3_cases import (
    batch,
    gathered_state,
    loss_fn,
    make_model,
    partition_tensors,
    state_bytes_per_element,
    train_steps,
)

import ds_zero
from ds_comm.testing import run_ranks

BF16 = {"bf16_master_weights_and_gradients": True, "bf16_optimizer_states": True}
STEPS = 6
LR = 1e-2
STAGE3 = {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 4000}


def _build(stage: int, bf16_masters: bool, **config: Any) -> tuple[torch.nn.Module, Any]:
    model = make_model().to(torch.bfloat16)
    base = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.01, foreach=False
    )
    kwargs = BF16 if bf16_masters else {}
    if stage == 3:
        opt = ds_zero.DeepSpeedZeroOptimizer_Stage3(model, base, config={**STAGE3, **config}, **kwargs)
    else:
        cfg = ds_zero.ZeroConfig(stage=stage, reduce_bucket_size=500, allgather_bucket_size=1000, **config)
        opt = ds_zero.DeepSpeedZeroOptimizer(base, config=cfg, module=model, **kwargs)
    return model, opt


def _params(model: torch.nn.Module, stage: int) -> dict[str, torch.Tensor]:
    if stage == 3:
        return gathered_state(model)
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def _reference(world: int) -> tuple[dict[str, torch.Tensor], list[list[float]], list[torch.dtype]]:
    """The same math in plain PyTorch, every rank's micro-batch on this one process."""
    model = make_model().to(torch.bfloat16)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.01, foreach=False)
    losses: list[list[float]] = []
    for step in range(STEPS):
        sums = [torch.zeros_like(p, dtype=torch.float32) for p in params]
        per_rank = []
        for r in range(world):
            model.zero_grad(set_to_none=True)
            idx, tgt = batch(r, step, 0)
            loss = loss_fn(model(idx), tgt)
            loss.backward()
            per_rank.append(loss.item())
            for s, p in zip(sums, params, strict=True):
                s.add_(p.grad.float())
        for s, p in zip(sums, params, strict=True):
            p.grad = (s / world).to(torch.bfloat16)
        opt.step()
        losses.append(per_rank)
    states = [t.dtype for st in opt.state.values() for k, t in st.items() if k != "step"]
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}, losses, states


def _vs_reference(rank: int, world: int, stage: int) -> dict[str, Any]:
    model, opt = _build(stage, True)
    losses = train_steps(model, opt, rank, range(STEPS), gas=1)
    masters, grads, states = partition_tensors(opt, stage)
    out = {
        "params": _params(model, stage),
        "losses": losses,
        "dtypes": {t.dtype for t in [*masters, *states]} | {opt.master_weights_and_grads_dtype},
        "bytes_bf16": state_bytes_per_element(opt, model, rank, stage),
    }
    out["ref_params"], out["ref_losses"], out["ref_state_dtypes"] = _reference(world)
    fp32_model, fp32_opt = _build(stage, False)
    train_steps(fp32_model, fp32_opt, rank, range(STEPS), gas=1)
    out["bytes_fp32"] = state_bytes_per_element(fp32_opt, fp32_model, rank, stage)
    out["fp32_params"] = _params(fp32_model, stage)
    return out


def _all_stages(rank: int, world: int) -> dict[int, dict[str, Any]]:
    return {stage: _vs_reference(rank, world, stage) for stage in (1, 2, 3)}


@pytest.fixture(scope="module")
def results() -> dict[int, dict[str, Any]]:
    return run_ranks(2, _all_stages, timeout_s=240)[0]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_masters_match_plain_pytorch(stage: int, results: dict[int, dict[str, Any]]) -> None:
    res = results[stage]
    assert res["dtypes"] == {torch.bfloat16}, f"masters/moments are {res['dtypes']}, not bf16"
    assert set(res["ref_state_dtypes"]) == {torch.bfloat16}
    ref = res["ref_params"]
    assert set(res["params"]) == set(ref)
    worst = 0.0
    for name, value in res["params"].items():
        err = (value - ref[name]).abs()
        bound = ref[name].abs() * 2.0**-7 + 1e-6
        worst = max(worst, float((err / bound).max()))
        assert bool((err <= bound).all()), f"{name}: off the reference by up to {float(err.max())}"
    ref_rank0 = [step[0] for step in res["ref_losses"]]
    assert max(abs(a - b) for a, b in zip(res["losses"], ref_rank0, strict=True)) <= 1e-3
    # the fp32-master run lands elsewhere: the comparison can tell the two apart
    fp32_off = max(float((v - ref[k]).abs().max()) for k, v in res["fp32_params"].items())
    assert fp32_off > 1e-3, "fp32 masters gave the bf16-master result: the check cannot fail"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_model_state_bytes_per_parameter(stage: int, results: dict[int, dict[str, Any]]) -> None:
    assert results[stage]["bytes_bf16"] == pytest.approx(8.0)
    assert results[stage]["bytes_fp32"] == pytest.approx(16.0)


# ----- checkpoints ---------------------------------------------------------------------------------------


def _all_state_dicts(opt: Any) -> list[dict[str, Any]]:
    snapshot = copy.deepcopy(opt.state_dict())
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, snapshot)
    return gathered


def _checkpoint(rank: int, world: int, stage: int) -> dict[str, Any]:
    model, opt = _build(stage, True)
    train_steps(model, opt, rank, range(3), gas=1)
    saved = _all_state_dicts(opt)
    train_steps(model, opt, rank, range(3, 6), gas=1)
    straight = _params(model, stage)

    resumed_model, resumed = _build(stage, True)
    resumed.load_state_dict(saved)
    train_steps(resumed_model, resumed, rank, range(3, 6), gas=1)

    # the bf16-master checkpoint into an fp32-master run: converted (widened, exactly)
    wide_model, wide = _build(stage, False)
    wide.load_state_dict(saved)
    bf16_masters, _, bf16_states = partition_tensors(_build_loaded(stage, saved), stage)
    fp32_masters, _, fp32_states = partition_tensors(wide, stage)
    return {
        "master_dtype": {sd["master_dtype"] for sd in saved},
        "straight": straight,
        "resumed": _params(resumed_model, stage),
        "wide_dtypes": {t.dtype for t in [*fp32_masters, *fp32_states]},
        "wide_equal": len(fp32_states) == len(bf16_states) > 0
        and all(
            torch.equal(a.float(), b)
            for a, b in zip([*bf16_masters, *bf16_states], [*fp32_masters, *fp32_states], strict=True)
        ),
    }


def _build_loaded(stage: int, saved: list[dict[str, Any]]) -> Any:
    _, opt = _build(stage, True)
    opt.load_state_dict(saved)
    return opt


def _checkpoint_all(rank: int, world: int) -> dict[int, dict[str, Any]]:
    return {stage: _checkpoint(rank, world, stage) for stage in (1, 2, 3)}


@pytest.fixture(scope="module")
def checkpoint_results() -> dict[int, dict[str, Any]]:
    return run_ranks(2, _checkpoint_all, timeout_s=240)[0]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_checkpoint_round_trip_resumes_exactly(stage: int, checkpoint_results: dict[int, dict[str, Any]]) -> None:
    res = checkpoint_results[stage]
    assert res["master_dtype"] == {"bfloat16"}
    for name, value in res["straight"].items():
        assert torch.equal(value, res["resumed"][name]), f"{name} differs after resuming"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_checkpoint_loads_into_fp32_masters(stage: int, checkpoint_results: dict[int, dict[str, Any]]) -> None:
    res = checkpoint_results[stage]
    assert res["wide_dtypes"] == {torch.float32}
    assert res["wide_equal"], "the widened masters/moments differ from the bf16 ones"


# ----- refusals ------------------------------------------------------------------------------------------


def _refusal(rank: int, world: int, stage: int, kwargs: dict[str, bool], config: dict[str, Any]) -> str:
    model = make_model().to(torch.bfloat16)
    base = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    try:
        if stage == 3:
            ds_zero.DeepSpeedZeroOptimizer_Stage3(model, base, config={**STAGE3, **config}, **kwargs)
        else:
            ds_zero.DeepSpeedZeroOptimizer(
                base, config=ds_zero.ZeroConfig(stage=stage, **config), module=model, **kwargs
            )
    except ValueError as err:
        return str(err)
    return "accepted"


CPU_OFFLOAD = {"offload_optimizer": {"device": "cpu"}}


@pytest.mark.parametrize(
    ("kwargs", "config", "needle"),
    [
        ({"bf16_optimizer_states": True}, {}, "bf16.bf16_optimizer_states=true needs bf16.bf16_master_weights"),
        ({"bf16_master_weights_and_gradients": True}, {}, "bf16.bf16_master_weights_and_grads=true with bf16.bf16_opt"),
        (BF16, CPU_OFFLOAD, "with optimizer offload needs DeepSpeedCPUAdam as the base optimizer"),
    ],
    ids=["states-without-masters", "masters-without-states", "cpu-offload-torch-adamw"],
)
@pytest.mark.parametrize("stage", [2, 3])
def test_refused_combinations_name_the_key(stage: int, kwargs: dict[str, bool], config: dict, needle: str) -> None:
    message = run_ranks(1, _refusal, stage, kwargs, config, timeout_s=60)[0]
    assert needle in message, message


def _cpu_adam_refusal(rank: int, world: int, fp32_states: bool) -> str:
    import ds_ops

    model = make_model().to(torch.bfloat16)
    params = [p for p in model.parameters() if p.requires_grad]
    base = ds_ops.DeepSpeedCPUAdam(params, lr=LR, fp32_optimizer_states=fp32_states)
    try:
        ds_zero.DeepSpeedZeroOptimizer(base, config=ds_zero.ZeroConfig(stage=2, **CPU_OFFLOAD), module=model, **BF16)
    except ValueError as err:
        return str(err)
    return "accepted"


def test_offloaded_bf16_states_need_a_cpu_adam_with_bf16_moments() -> None:
    """As DeepSpeed asserts: offloaded `bf16_optimizer_states` need DeepSpeedCPUAdam(fp32_optimizer_states=False)."""
    refused, accepted = (run_ranks(1, _cpu_adam_refusal, fp32, timeout_s=60)[0] for fp32 in (True, False))
    assert "needs DeepSpeedCPUAdam(fp32_optimizer_states=False)" in refused, refused
    assert accepted == "accepted"
