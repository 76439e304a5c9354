"""Universal checkpoints into other models. An AutoTP model (`tensor_parallel.autotp_size`): each tensor-parallel
rank takes its shard of every whole parameter and of its optimizer state (Adam's exp_avg, exp_avg_sq).
A MoE model: refused by name (DeepSpeed's universal format has per-expert files only for AutoEP).

A tiny HF Llama (fused-free q/k/v, grouped kv heads) trains 3 steps without tensor parallelism under
ZeRO 1 and saves; `ds_to_universal` converts the save; the universal checkpoint loads at TP=2 (ZeRO 1
and 2) and continues 3 steps: the losses are those of the run that went on at TP=1 (fp32, 1e-5, the
tolerance of TP against data parallelism alone in `test_dist_autotp_training.py`).

Needs ds-zero, ds-parallel and transformers (the `ds-engine[all]` session); skipped without them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ds_comm.testing import run_ranks

pytest.importorskip("ds_zero", reason="universal checkpoints need ds-zero: pip install 'ds-engine[zero]'")
pytest.importorskip("ds_parallel", reason="AutoTP needs ds-parallel: pip install 'ds-engine[parallel]'")
pytest.importorskip("transformers")

from tiny_hf_models import batch, build  # noqa: E402

BEFORE, AFTER = 3, 3
TAG = f"global_step{BEFORE}"


def _config(tp: int, stage: int, universal: bool) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
    }
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def _steps(engine: Any, first: int, count: int) -> list[float]:
    losses = []
    for step in range(first, first + count):
        ids = batch(seed=1000 + step, size=2, seq=8)  # one data-parallel replica: every rank the same batch
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _save_then_continue(rank: int, world: int, save_dir: str) -> list[float]:
    import ds_engine

    model = build("llama", kv_heads=2)
    engine, *_ = ds_engine.initialize(model=model, config=_config(1, 1, False))
    _steps(engine, 0, BEFORE)
    engine.save_checkpoint(save_dir)
    return _steps(engine, BEFORE, AFTER)


def _load_universal(rank: int, world: int, load_dir: str, tp: int, stage: int) -> dict[str, Any]:
    import ds_engine

    model = build("llama", kv_heads=2, seed=7)  # another init: everything must come from the checkpoint
    engine, *_ = ds_engine.initialize(model=model, config=_config(tp, stage, True))
    q_proj = model.model.layers[0].self_attn.q_proj.weight
    path, _ = engine.load_checkpoint(load_dir)
    assert path is not None and engine.global_steps == BEFORE
    return {"losses": _steps(engine, BEFORE, AFTER), "local_q_rows": q_proj.shape[0]}


@pytest.fixture(scope="module")
def universal(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float]]:
    import ds_zero

    root = tmp_path_factory.mktemp("autotp_universal")
    (reference,) = run_ranks(1, _save_then_continue, str(root), timeout_s=180)
    ds_zero.convert_to_universal(root / TAG, root / f"{TAG}_universal", inject_missing_state=True)
    return root, reference


@pytest.mark.parametrize("stage", [1, 2])
def test_universal_checkpoint_loads_at_tp2_and_continues_like_tp1(universal, stage: int) -> None:
    root, reference = universal
    results = run_ranks(2, _load_universal, str(root), 2, stage, timeout_s=240)
    for r in results:
        assert r["local_q_rows"] == 16  # hidden 32 cut in two: the weights are shards
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(reference), rtol=0, atol=1e-5)


def _moe_refused(rank: int, world: int, load_dir: str) -> str:
    from moe_cases import TinyMoE, config

    import ds_engine

    torch.manual_seed(0)
    model = TinyMoE(ep_size=1)
    cfg = {**config(1, 0.0, 1e-2), "checkpoint": {"load_universal": True}}
    engine, *_ = ds_engine.initialize(model=model, config=cfg)
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    with pytest.raises(ValueError, match="cannot be loaded into a model with MoE layers") as err:
        engine.load_checkpoint(load_dir, tag=f"{TAG}_universal")
    assert all(torch.equal(before[k], v) for k, v in engine.module.state_dict().items())
    return str(err.value)


def test_moe_model_refuses_a_universal_checkpoint(universal) -> None:
    root, _ = universal
    (message,) = run_ranks(1, _moe_refused, str(root), timeout_s=180)
    assert "load the ZeRO checkpoint itself" in message
