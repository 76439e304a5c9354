"""AutoTP by a Hugging Face tensor-parallel plan, on 2 gloo ranks, against the unsharded model.

Each case shards a tiny HF model for training with `shard_model(tp_plan=extract_hf_tp_plan(model))`
and checks that the layers are cut as the plan says (layer types and local weight shapes), and that
logits, the loss and every whole gradient (shards gathered back) equal the unsharded model's on the
same batch, fp32 to 1e-5 (the sums run in another order; the largest error seen is ~1e-7).
Llama's own plan cuts the output head (gathered output), Qwen3's also sums the gradients of the
replicated q/k norms over the group, and a custom plan entry overrides what the name-based parser
would do. A plan with a style AutoTP does not support (Olmo2's `rowwise_split_input`) is refused before
any layer is touched. Key/value heads that do not divide over the ranks split unevenly, whole heads per
rank (3 over 2 ranks: 2/1; 2 over 3 ranks: 1/1/0, the last rank holding no attention shard), and the
numerics still equal the unsharded model's, as in DeepSpeed 0.19.8.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ds_comm.testing import run_ranks

pytest.importorskip("transformers")

from tiny_hf import VOCAB, batch, build  # noqa: E402

TOL = 1e-5
HIDDEN, INTER = 32, 72


def _whole_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from ds_parallel.tensor import tp_layers

    layers = tp_layers(model)
    grads = {}
    for name, param in model.named_parameters():
        path, _, pname = name.rpartition(".")
        layer = layers.get(path)
        assert param.grad is not None, name
        grads[name] = param.grad if layer is None else layer.full_like(pname, param.grad)
    return grads


def _run(
    rank: int, world: int, family: str, custom: dict[str, str] | None, sizes: dict[str, int] | None = None
) -> dict[str, Any]:
    from ds_parallel import build_mesh
    from ds_parallel.tensor import extract_hf_tp_plan, shard_model

    ids = batch()
    ref = build(family, **(sizes or {})).train()
    ref_out = ref(ids, labels=ids)
    ref_out.loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    model = build(family, **(sizes or {})).train()
    if custom is not None:
        model._tp_plan = custom  # an instance plan: its entries override the config's for the same pattern
    plan = extract_hf_tp_plan(model)
    shard_model(model, tp_group=build_mesh(tp=world).group("tp"), training=True, tp_plan=plan)
    out = model(ids, labels=ids)
    out.loss.backward()
    grads = _whole_grads(model)
    layer0 = model.model.layers[0]
    modules = {
        "q": layer0.self_attn.q_proj,
        "o": layer0.self_attn.o_proj,
        "up": layer0.mlp.up_proj,
        "down": layer0.mlp.down_proj,
        "head": model.lm_head,
        "embed": model.model.embed_tokens,
    }
    return {
        "plan": plan,
        "logits_err": (out.logits - ref_out.logits).abs().max().item(),
        "logits_shape": tuple(out.logits.shape),
        "loss_err": abs(out.loss.item() - ref_out.loss.item()),
        "grad_err": max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads),
        "grad_names_equal": grads.keys() == ref_grads.keys(),
        "types": {k: type(m).__name__ for k, m in modules.items()},
        "shapes": {k: tuple(m.weight.shape) for k, m in modules.items()},
        "gather": {k: getattr(m, "gather_output", None) for k, m in modules.items()},
    }


def _check_numerics(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["logits_shape"] == (2, 12, VOCAB)
        assert r["logits_err"] < TOL, r
        assert r["loss_err"] < TOL, r
        assert r["grad_names_equal"]
        assert r["grad_err"] < TOL, r


def test_llama_plan_cuts_as_planned_and_matches_unsharded() -> None:
    results = run_ranks(2, _run, "llama", None, timeout_s=180)
    _check_numerics(results)
    r = results[0]
    assert r["plan"]["lm_head"] == "colwise_gather_output"
    assert r["types"] == {
        "q": "LinearLayer",
        "o": "LinearAllreduce",
        "up": "LinearLayer",
        "down": "LinearAllreduce",
        "head": "LinearLayer",  # the name-based policy keeps the head whole in training; the plan cuts it
        "embed": "Embedding",  # embedding_rowwise: kept whole
    }
    assert r["shapes"] == {
        "q": (HIDDEN // 2, HIDDEN),
        "o": (HIDDEN, HIDDEN // 2),
        "up": (INTER // 2, HIDDEN),
        "down": (HIDDEN, INTER // 2),
        "head": (VOCAB // 2, HIDDEN),
        "embed": (VOCAB, HIDDEN),
    }
    assert r["gather"]["head"] is True and r["gather"]["q"] is False


def test_qwen3_plan_sums_replicated_norm_gradients() -> None:
    # q_norm/k_norm normalize the local heads: without the plan's gradient all-reduce each rank's
    # gradient would be partial and the whole-gradient check below would fail.
    results = run_ranks(2, _run, "qwen3", None, timeout_s=180)
    assert results[0]["plan"]["layers.*.self_attn.q_norm"] == "replicated_with_grad_allreduce"
    _check_numerics(results)


#: Whole-width MLP on every rank: the parser would cut down_proj by rows (an all-reduced partial sum);
#: this plan makes it a column-parallel layer whose output is gathered, so every MLP layer differs.
_GATHERED_MLP = {
    "layers.*.mlp.gate_proj": "colwise_gather_output",
    "layers.*.mlp.up_proj": "colwise_gather_output",
    "layers.*.mlp.down_proj": "colwise_gather_output",
}


def test_custom_plan_entry_beats_the_name_parser() -> None:
    from ds_parallel.tensor import find_block_policies

    parser_rows = find_block_policies(build("llama"))[0].row_parallel
    assert any("down_proj" in name for name in parser_rows)  # what the parser would do
    results = run_ranks(2, _run, "llama", _GATHERED_MLP, timeout_s=180)
    _check_numerics(results)
    r = results[0]
    assert r["types"]["down"] == "LinearLayer" and r["gather"]["down"] is True
    assert r["shapes"]["down"] == (HIDDEN // 2, INTER)
    assert r["shapes"]["up"] == (INTER // 2, HIDDEN) and r["gather"]["up"] is True
    assert r["types"]["o"] == "LinearAllreduce"  # the config's entries the instance did not override


def _refused(rank: int, world: int, family: str, kwargs: dict[str, int]) -> dict[str, Any]:
    from ds_parallel import build_mesh
    from ds_parallel.tensor import extract_hf_tp_plan, shard_model, tp_layers

    model = build(family, **kwargs)
    try:
        shard_model(model, tp_group=build_mesh(tp=world).group("tp"), training=True, tp_plan=extract_hf_tp_plan(model))
    except ValueError as err:
        return {"msg": str(err), "layers": len(tp_layers(model)), "parsed": getattr(model, "ds_autotp_parsed", False)}
    return {"msg": "no error"}


def test_unsupported_plan_style_is_refused_before_any_work() -> None:
    for r in run_ranks(2, _refused, "olmo2", {}, timeout_s=120):
        assert "'model.layers.0.self_attn.o_proj'" in r["msg"] and "'rowwise_split_input'" in r["msg"], r
        assert r["layers"] == 0 and r["parsed"] is False


@pytest.mark.parametrize(("world", "kv_heads", "q_rows"), [(2, 3, (32, 16)), (3, 2, (24, 24, 0))])
def test_kv_heads_not_dividing_split_unevenly_and_match_unsharded(world: int, kv_heads: int, q_rows: tuple) -> None:
    sizes = {"kv_heads": kv_heads, "heads": 6, "hidden": 48}  # head_dim 8
    results = run_ranks(world, _run, "llama", None, sizes, timeout_s=180)
    _check_numerics(results)
    assert tuple(r["shapes"]["q"][0] for r in results) == q_rows  # whole heads: 3 query heads per kv head
