"""Gradient clipping and fp16/bf16 with `"tensor_parallel": {"autotp_size": 2}`: the norm is the whole model's.

A tiny HF Llama trained with TP=2 and `gradient_clipping` 0.05 (small enough that every step clips)
gives, at ZeRO 0, 1 and 2, the losses of plain torch on the whole model with `clip_grad_norm_` (1e-5
over 10 steps), and `get_global_grad_norm()` equals torch's norm at every step (1e-5 relative); with
TP=2 x DP=2 on 4 ranks it equals data parallelism alone. With fp16, an inf injected into one TP rank's
shard skips the step on both ranks and halves the loss scale on both; bf16 with clipping trains like
bf16 without tensor parallelism.

Needs ds-parallel and transformers (the `ds-engine[all]` session); skipped without them.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ds_comm.testing import run_ranks

pytest.importorskip("ds_parallel", reason="AutoTP needs ds-parallel: pip install 'ds-engine[parallel]'")
pytest.importorskip("transformers")

from tiny_hf_models import batch, build  # noqa: E402

STEPS = 10
CLIP = 0.05
LR, MOMENTUM = 0.1, 0.9


def _config(tp: int, stage: int, precision: str = "fp32") -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        # SGD: the update is linear in the (clipped) gradients, so runs compare tightly
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": MOMENTUM}},
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage},
    }
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1, "loss_scale_window": 1000}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    return cfg


def _torch_reference() -> dict[str, list[float]]:
    """Plain torch on the whole model: the same batches, SGD with momentum, `clip_grad_norm_`."""
    model = build("llama", kv_heads=2)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses, norms = [], []
    for step in range(STEPS):
        ids = batch(seed=1000 + step, size=2, seq=8)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms}


def _train(rank: int, world: int, tp: int, stage: int, precision: str = "fp32") -> dict[str, Any]:
    import ds_engine as deepspeed

    model = build("llama", kv_heads=2)
    model.train()
    engine, *_ = deepspeed.initialize(model=model, config=_config(tp, stage, precision))
    dp_rank, dp = engine.get_data_parallel_rank(), engine.dp_world_size
    losses, norms = [], []
    for step in range(STEPS):
        ids = batch(seed=1000 + step * dp + dp_rank, size=2, seq=8)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(engine.get_global_grad_norm())
    return {"losses": losses, "norms": norms, "skipped": engine.skipped_steps}


@pytest.fixture(scope="module")
def reference() -> dict[str, list[float]]:
    return _torch_reference()


@pytest.mark.timeout(400)
@pytest.mark.parametrize("stage", [0, 2])  # stage 1 clips through the same code as stage 2
def test_tp2_clipping_equals_torch_on_the_whole_model(stage: int, reference: dict[str, list[float]]) -> None:
    assert min(reference["norms"]) > CLIP  # every step clips
    for r in run_ranks(2, _train, 2, stage, timeout_s=240):
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(reference["losses"]), rtol=0, atol=1e-5)
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(reference["norms"]), rtol=1e-5, atol=0)


@pytest.mark.timeout(600)
def test_tp2_by_dp2_zero2_clipping_equals_dp2() -> None:
    ref = run_ranks(2, _train, 1, 2, timeout_s=240)
    results = run_ranks(4, _train, 2, 2, timeout_s=300)
    for rank, r in enumerate(results):
        mine = ref[rank // 2]  # consecutive ranks form a TP group; the groups are the DP replicas
        assert min(mine["norms"]) > CLIP
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(mine["losses"]), rtol=0, atol=1e-5)
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(mine["norms"]), rtol=1e-5, atol=0)


def _fp16_inject(rank: int, world: int, stage: int) -> dict[str, Any]:
    import ds_engine as deepspeed

    model = build("llama", kv_heads=2)
    model.train()
    engine, *_ = deepspeed.initialize(model=model, config=_config(2, stage, "fp16"))
    cut = model.model.layers[0].mlp.gate_proj.weight
    assert getattr(cut, "tensor_model_parallel", False)
    scales, skipped, changed = [], [], []
    for step in range(3):
        ids = batch(seed=1000 + step, size=2, seq=8)
        handle = cut.register_hook(lambda g: g + float("inf")) if step == 1 and rank == 1 else None
        before = cut.detach().clone()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        if handle is not None:
            handle.remove()
        scales.append(engine.optimizer.loss_scale)
        skipped.append(engine.skipped_steps)
        changed.append(not torch.equal(before, cut.detach()))
    return {"scales": scales, "skipped": skipped, "changed": changed}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("stage", [0, 2])
def test_fp16_an_inf_in_one_shard_skips_both_tp_ranks(stage: int) -> None:
    for r in run_ranks(2, _fp16_inject, stage, timeout_s=240):
        assert r["skipped"] == [0, 1, 1], r
        assert r["changed"] == [True, False, True], r
        assert r["scales"] == [256.0, 128.0, 128.0], r


@pytest.mark.timeout(600)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_16bit_tp2_clipping_trains_like_one_rank(precision: str) -> None:
    (ref,) = run_ranks(1, _train, 1, 1, precision, timeout_s=180)
    for r in run_ranks(2, _train, 2, 1, precision, timeout_s=240):
        assert r["skipped"] == ref["skipped"] == 0
        # 16-bit matmuls over half the features round differently; the norms agree to that rounding
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=0, atol=2e-2)
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(ref["norms"]), rtol=2e-2, atol=0)
