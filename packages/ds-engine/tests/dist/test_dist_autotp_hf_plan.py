"""initialize() with `tensor_parallel.autotp_size: 2` cuts a Hugging Face model by its tensor-parallel plan.

As DeepSpeed 0.19.8 does: a model carrying a plan (a tiny HF Llama: config, class and instance plans) is
cut as the plan says (its output head too, gathered), one without (OPT) by the module-name policy (head
replicated), a custom plan entry overrides the policy, and a plan style AutoTP does not support (Olmo2's
`rowwise_split_input`) is refused by initialize() before anything is cut. Training with TP=2 gives the
losses of TP=1 on the same batches (fp32, SGD, 1e-5 over 6 steps) and the same whole weights (1e-4).

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

STEPS = 6
#: The MLP whole on every rank: the module-name policy would cut down_proj by rows; this cuts it by
#: columns and gathers its output (an instance plan entry overrides the config's for the same pattern).
GATHERED_MLP = {
    "layers.*.mlp.gate_proj": "colwise_gather_output",
    "layers.*.mlp.up_proj": "colwise_gather_output",
    "layers.*.mlp.down_proj": "colwise_gather_output",
}


def _config(tp: int) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 1},
    }
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    return cfg


def _layer_kind(module: torch.nn.Module) -> str:
    gather = getattr(module, "gather_output", False)
    return f"{type(module).__name__}{'+gather' if gather else ''}:{tuple(module.weight.shape)}"


def _train(rank: int, world: int, family: str, tp: int, custom: dict[str, str] | None) -> dict[str, Any]:
    import ds_engine as deepspeed

    model = build(family).train()
    if custom is not None:
        model._tp_plan = custom
    engine, *_ = deepspeed.initialize(model=model, config=_config(tp))
    losses = []
    for step in range(STEPS):
        ids = batch(seed=100 + step, size=2, seq=8)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    decoder = model.model.decoder if family == "opt" else model.model
    layer0 = decoder.layers[0]
    mlp_down = layer0.fc2 if family == "opt" else layer0.mlp.down_proj
    return {
        "losses": losses,
        "full": {k: v.clone() for k, v in engine.module_state_dict().items()},
        "kinds": {
            "q": _layer_kind(layer0.self_attn.q_proj),
            "down": _layer_kind(mlp_down),
            "head": _layer_kind(model.lm_head),
        },
    }


def _same_training(results: list[dict[str, Any]], ref: dict[str, Any]) -> None:
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=0, atol=1e-5)
        assert r["full"].keys() == ref["full"].keys()
        for k, v in ref["full"].items():
            torch.testing.assert_close(r["full"][k], v, rtol=1e-4, atol=1e-4, msg=k)


@pytest.mark.timeout(900)
def test_llama_is_cut_by_its_plan_and_a_custom_entry_overrides_the_policy() -> None:
    (ref,) = run_ranks(1, _train, "llama", 1, None, timeout_s=240)
    planned = run_ranks(2, _train, "llama", 2, None, timeout_s=300)
    _same_training(planned, ref)
    assert planned[0]["kinds"] == {
        "q": "LinearLayer:(16, 32)",
        "down": "LinearAllreduce:(32, 36)",
        "head": "LinearLayer+gather:(48, 32)",  # the plan's colwise_gather_output head
    }
    custom = run_ranks(2, _train, "llama", 2, GATHERED_MLP, timeout_s=300)
    _same_training(custom, ref)
    assert custom[0]["kinds"]["down"] == "LinearLayer+gather:(16, 72)"  # not the policy's row-parallel cut


@pytest.mark.timeout(600)
def test_model_without_a_plan_is_cut_by_the_name_policy() -> None:
    (ref,) = run_ranks(1, _train, "opt", 1, None, timeout_s=240)
    results = run_ranks(2, _train, "opt", 2, None, timeout_s=300)
    _same_training(results, ref)
    assert results[0]["kinds"] == {
        "q": "LinearLayer:(16, 32)",
        "down": "LinearAllreduce:(32, 36)",
        "head": "Linear:(96, 32)",  # replicated in training, as before
    }


def _refused(rank: int, world: int) -> dict[str, Any]:
    import ds_engine as deepspeed
    from ds_parallel.tensor import tp_layers

    model = build("olmo2").train()
    try:
        deepspeed.initialize(model=model, config=_config(2))
    except ValueError as err:
        return {"msg": str(err), "layers": len(tp_layers(model))}
    return {"msg": "no error"}


def test_unsupported_plan_style_is_refused_before_anything_is_cut() -> None:
    for r in run_ranks(2, _refused, timeout_s=240):
        assert "'model.layers.0.self_attn.o_proj'" in r["msg"] and "'rowwise_split_input'" in r["msg"], r
        assert r["layers"] == 0
