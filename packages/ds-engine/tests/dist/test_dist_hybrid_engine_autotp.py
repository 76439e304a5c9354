"""The hybrid engine on an AutoTP-trained model (`tensor_parallel.autotp_size: 2`, ZeRO 1), 2 gloo ranks.

Generation runs the sharded model itself (its row-parallel layers all-reduce their outputs), so both
tensor-parallel ranks produce the unsharded model's greedy tokens; after a training step they equal those of
a copy trained with torch's SGD on the same batch (the TP group sees one batch, as DeepSpeed requires).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from ds_comm.testing import run_ranks

pytest.importorskip("ds_parallel", reason="AutoTP needs ds-parallel: pip install 'ds-engine[parallel]'")
pytest.importorskip("transformers")

from tiny_hf_models import batch, build, greedy  # noqa: E402

NEW_TOKENS = 6
LR = 0.1


def _generate(gen: Any, ids: torch.Tensor) -> Any:
    return greedy(gen, ids, NEW_TOKENS)


def _run(rank: int, world: int) -> dict[str, Any]:
    import ds_engine as deepspeed

    model = build("llama", kv_heads=2)
    ref = copy.deepcopy(model)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 1},
        "tensor_parallel": {"autotp_size": 2},
        "hybrid_engine": {"enabled": True},
    }
    engine, *_ = deepspeed.initialize(model=model, config=config)
    ids = batch(seed=3, size=2, seq=5)  # the same prompt on both ranks of the tensor-parallel group
    engine.eval()
    first = _generate(engine.generate, ids)
    with torch.no_grad():
        want_first = _generate(ref.generate, ids)
    engine.train()
    train = batch(seed=4, size=2, seq=8)
    loss = engine(input_ids=train, labels=train).loss
    engine.backward(loss)
    engine.step()
    ref.train()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    ref(input_ids=train, labels=train).loss.backward()
    ref_opt.step()
    ref.eval()
    engine.eval()
    after = _generate(engine.generate, ids)
    with torch.no_grad():
        want_after = _generate(ref.generate, ids)
    return {
        "kind": type(engine).__name__,
        "first": first.sequences,
        "want_first": want_first.sequences,
        "after": after.sequences,
        "want_after": want_after.sequences,
        "scores": max((a - b).abs().max().item() for a, b in zip(after.scores, want_after.scores, strict=True)),
    }


def test_hybrid_engine_generates_with_an_autotp_trained_model() -> None:
    results = run_ranks(2, _run, timeout_s=300)
    for rank, r in enumerate(results):
        assert r["kind"] == "DeepSpeedHybridEngine"
        assert torch.equal(r["first"], r["want_first"]), f"rank {rank} before training"
        assert torch.equal(r["after"], r["want_after"]), f"rank {rank} after one step"
        assert r["scores"] < 1e-4, f"rank {rank}: scores differ by {r['scores']}"
