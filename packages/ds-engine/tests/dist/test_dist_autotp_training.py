"""`"tensor_parallel": {"autotp_size": N}` in training: a tiny HF Llama trained with TP=2 gives the losses of
data parallelism alone (fp32, 1e-5 over 10 steps), also as TP=2 x DP=2 under ZeRO 1/2 on 4 ranks;
replicated weights stay identical on the TP ranks; checkpoints and `save_16bit_model` hold whole
weights (a TP=2 checkpoint loads at TP=1 with the same logits); mismatched batches in a TP group are refused;
a model sharded by `TpTrainingManager` before initialize() trains the same.

Needs ds-parallel and transformers (the `ds-engine[all]` session); skipped without them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ds_comm.testing import run_ranks

pytest.importorskip("ds_parallel", reason="AutoTP needs ds-parallel: pip install 'ds-engine[parallel]'")
pytest.importorskip("transformers")

from tiny_hf_models import batch, build  # noqa: E402

STEPS = 10


def _config(tp: int, stage: int) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        # SGD: the update is linear in the gradients, so the weights compare as tightly as the losses
        # (Adam divides by sqrt(v) and magnifies rounding on near-zero gradients).
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage},
    }
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    return cfg


def _train(rank: int, world: int, tp: int, stage: int, save_dir: str | None = None) -> dict[str, Any]:
    import ds_engine as deepspeed

    model = build("llama", kv_heads=2)
    model.train()
    engine, *_ = deepspeed.initialize(model=model, config=_config(tp, stage))
    dp_rank, dp = engine.get_data_parallel_rank(), engine.dp_world_size
    losses = []
    for step in range(STEPS):
        ids = batch(seed=1000 + step * dp + dp_rank, size=2, seq=8)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    probe = batch(seed=5, size=2, seq=8)
    with torch.no_grad():
        logits = engine(input_ids=probe).logits
    out: dict[str, Any] = {
        "losses": losses,
        "logits": logits,
        "full": {k: v.clone() for k, v in engine.module_state_dict().items()},
        "norm": model.model.norm.weight.detach().clone(),
        "dp": dp,
    }
    if save_dir is not None:
        engine.save_checkpoint(save_dir, tag="tp")
        engine.save_16bit_model(save_dir, "model16.bin")
    return out


@pytest.mark.parametrize("stage", [0, 1])
def test_tp2_losses_equal_data_parallel_alone(stage: int) -> None:
    (ref,) = run_ranks(1, _train, 1, stage, timeout_s=180)
    results = run_ranks(2, _train, 2, stage, timeout_s=240)
    for r in results:
        assert r["dp"] == 1
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=0, atol=1e-5)
        for k, v in ref["full"].items():
            torch.testing.assert_close(r["full"][k], v, rtol=1e-4, atol=1e-4, msg=k)
    assert torch.equal(results[0]["norm"], results[1]["norm"])  # replicated weights agree on the TP ranks


def test_tp2_by_dp2_zero2_equals_dp2() -> None:
    ref = run_ranks(2, _train, 1, 2, timeout_s=240)
    results = run_ranks(4, _train, 2, 2, timeout_s=300)
    for rank, r in enumerate(results):
        assert r["dp"] == 2
        mine = ref[rank // 2]  # mesh layout: consecutive ranks form a TP group, groups are the DP replicas
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(mine["losses"]), rtol=0, atol=1e-5)
    for r in results[1:]:
        assert torch.equal(r["norm"], results[0]["norm"])


def _train_managed(rank: int, world: int) -> dict[str, Any]:
    """DeepSpeed's `TpTrainingManager` shards the model before initialize(), which keeps its shards."""
    import ds_engine as deepspeed
    from ds_engine.runtime.tensor_parallel import TpTrainingManager

    model = build("llama", kv_heads=2)
    model.train()
    manager = TpTrainingManager(model, tp_size=2, dtype=torch.float32)
    sharded = dict(model.named_parameters())
    assert manager.module is model and manager.tp_config.tp_size == 2
    assert getattr(model.model.layers[0].mlp.gate_proj.weight, "tensor_model_parallel", False)
    engine, *_ = deepspeed.initialize(model=model, config=_config(2, 0))
    assert all(p is sharded[n] for n, p in model.named_parameters())  # not sharded twice
    losses = []
    for step in range(STEPS):
        ids = batch(seed=1000 + step, size=2, seq=8)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses}


@pytest.mark.timeout(600)
def test_tp_training_manager_then_initialize_equals_data_parallel_alone() -> None:
    (ref,) = run_ranks(1, _train, 1, 0, timeout_s=180)
    for r in run_ranks(2, _train_managed, timeout_s=240):
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=0, atol=1e-5)


def _load_at_tp1(rank: int, world: int, save_dir: str) -> dict[str, Any]:
    import ds_engine as deepspeed

    model = build("llama", kv_heads=2, seed=3)
    engine, *_ = deepspeed.initialize(model=model, config=_config(1, 0))
    engine.load_checkpoint(save_dir, tag="tp")  # optimizer state too (test_dist_autotp_checkpoint_optimizer.py)
    probe = batch(seed=5, size=2, seq=8)
    with torch.no_grad():
        logits = engine(input_ids=probe).logits
    saved16 = torch.load(Path(save_dir) / "model16.bin", weights_only=True)
    same16 = saved16.keys() == model.state_dict().keys() and all(
        torch.equal(saved16[k], v) for k, v in model.state_dict().items()
    )
    return {"logits": logits, "same16": same16}


def test_checkpoint_at_tp2_loads_at_tp1(tmp_path: Path) -> None:
    trained = run_ranks(2, _train, 2, 0, str(tmp_path), timeout_s=240)
    (loaded,) = run_ranks(1, _load_at_tp1, str(tmp_path), timeout_s=180)
    torch.testing.assert_close(loaded["logits"], trained[0]["logits"], rtol=0, atol=1e-5)
    assert loaded["same16"]


def _mismatched(rank: int, world: int) -> str:
    import ds_engine as deepspeed

    engine, *_ = deepspeed.initialize(model=build("llama", kv_heads=2), config=_config(2, 0))
    ids = batch(seed=rank, size=2, seq=8)  # each TP rank a different batch: wrong
    try:
        engine(input_ids=ids, labels=ids)
    except AssertionError as err:  # DeepSpeed's type; ds's is a ValueError too
        assert isinstance(err, ValueError)
        return "\n".join([str(err), *getattr(err, "__notes__", [])])
    return "no error"


def test_different_batches_in_a_tp_group_are_refused() -> None:
    for msg in run_ranks(2, _mismatched, timeout_s=180):
        assert msg.startswith("Data inconsistency within the TP group. Please check the Dataloader"), msg
        assert "received different inputs in their first forward" in msg, msg
