"""The hybrid engine in one process (stage 0): the `hybrid_engine` section, which engine initialize()
builds, LoRA fusion for generate() (scores bit for bit those of a merged copy, weights bitwise back),
generate() on a module without one, the eval()/train() latency report, and refused configs.

The ZeRO-3 behaviour (one gather per parameter per call, the RLHF loop) is in dist/test_dist_hybrid_engine.py.
"""

from __future__ import annotations

import copy
import logging
import warnings
from typing import Any

import pytest
import torch
from ds_engine_testkit import base_config, make_engine, tiny_net

import ds_engine
from ds_engine import DeepSpeedConfig, DeepSpeedConfigError

#: DeepSpeed 0.19.8's HybridEngineConfig defaults
DEEPSPEED_DEFAULTS = {
    "enabled": False,
    "max_out_tokens": 512,
    "inference_tp_size": 1,
    "release_inference_cache": False,
    "pin_parameters": True,
    "tp_gather_partition_size": 8,
    "enable_cuda_graph": False,
}


def _hybrid(**section: Any) -> dict[str, Any]:
    return base_config(hybrid_engine={"enabled": True, **section})


def test_section_has_deepspeeds_keys_and_defaults() -> None:
    assert DeepSpeedConfig({"train_batch_size": 2}).hybrid_engine.model_dump() == DEEPSPEED_DEFAULTS
    cfg = DeepSpeedConfig(
        {"train_batch_size": 2, "hybrid_engine": {"enabled": True, "pin_parameters": False, "max_out_tokens": 64}}
    )
    assert cfg.hybrid_engine.enabled and not cfg.hybrid_engine.pin_parameters
    assert cfg.hybrid_engine.max_out_tokens == 64


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"inference_tp_size": 2}, r"hybrid_engine.inference_tp_size: .*=2 is not supported by ds \(tensor-parallel"),
        ({"enable_cuda_graph": True}, r"hybrid_engine.enable_cuda_graph: .*=True is not supported by ds \(CUDA-graph"),
        ({"max_out_tokens": 0}, r"hybrid_engine.max_out_tokens: Input should be greater than 0"),
        ({"tp_gather_partition_size": True}, r"hybrid_engine.tp_gather_partition_size: .*boolean"),
        ({"pin_parameter": False}, r"hybrid_engine.pin_parameter: unknown key .*did you mean 'pin_parameters'"),
        ({"enabled": "yes please"}, r"hybrid_engine.enabled: Input should be a valid boolean"),
    ],
)
def test_bad_sections_name_the_key(section: dict[str, Any], message: str) -> None:
    with pytest.raises(DeepSpeedConfigError, match=message):
        DeepSpeedConfig({"train_batch_size": 2, "hybrid_engine": {"enabled": True, **section}})


def test_keys_without_effect_warn_naming_the_key() -> None:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        make_engine(tiny_net(0), _hybrid(max_out_tokens=64, tp_gather_partition_size=2))
    messages = [str(w.message) for w in record if issubclass(w.category, UserWarning)]
    assert any(m.startswith("hybrid_engine.max_out_tokens=64 has no effect in ds") for m in messages)
    assert any(m.startswith("hybrid_engine.tp_gather_partition_size=2 has no effect in ds") for m in messages)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_engine(tiny_net(0), _hybrid(pin_parameters=False, release_inference_cache=True))


def test_initialize_builds_the_hybrid_engine_only_when_enabled() -> None:
    from ds_engine.runtime.hybrid_engine import DeepSpeedHybridEngine

    assert DeepSpeedHybridEngine is ds_engine.DeepSpeedHybridEngine
    engine = make_engine(tiny_net(0), _hybrid())
    assert type(engine) is DeepSpeedHybridEngine and isinstance(engine, ds_engine.DeepSpeedEngine)
    assert not engine.Z3_enabled and engine.gather_all_layers and engine.all_lora_params == []
    assert engine._config.hybrid_engine.enabled  # DeepSpeed's path to the section
    assert type(make_engine(tiny_net(0), base_config(hybrid_engine={"enabled": False}))) is ds_engine.DeepSpeedEngine


def test_explain_names_the_hybrid_engine(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from ds_engine.explain import main

    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_batch_size": 2, "hybrid_engine": {"enabled": True}}))
    assert main([str(path), "--world-size", "1", "--device", "cpu"]) == 0
    assert "engine: DeepSpeedHybridEngine" in capsys.readouterr().out


def test_generate_needs_a_module_with_generate() -> None:
    engine = make_engine(tiny_net(0), _hybrid())
    with pytest.raises(AttributeError, match=r"engine.generate\(\): the wrapped module \(TinyNet\) has no generate"):
        engine.generate(torch.zeros(1, 8))


def test_a_pipeline_module_is_refused() -> None:
    ds_pipe = pytest.importorskip("ds_pipe")
    layers = [ds_pipe.LayerSpec(torch.nn.Linear, 4, 2)]
    model = ds_pipe.PipelineModule(layers, num_stages=1, loss_fn=torch.nn.functional.mse_loss)
    with pytest.raises(DeepSpeedConfigError, match=r"hybrid_engine.enabled: the hybrid engine wraps a plain module"):
        ds_engine.initialize(model=model, config=_hybrid(), dist_init_required=False)


def test_eval_reports_the_latency_split_of_the_last_round(caplog: pytest.LogCaptureFixture) -> None:
    engine = make_engine(tiny_net(0), _hybrid())
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    engine.eval()  # the first eval starts the clock
    engine.train()
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()
    with caplog.at_level(logging.INFO, logger="ds_engine._hybrid.engine"):
        engine.eval()
    assert engine.training is False and engine._training_latency == 0.0
    assert any("|E2E latency=" in r.message and "|Training time=" in r.message for r in caplog.records)


# -- LoRA (needs transformers) ------------------------------------------------------------------------------
def _generate(gen: Any, ids: torch.Tensor) -> Any:
    return gen(
        ids, max_new_tokens=5, do_sample=False, eos_token_id=None, output_scores=True, return_dict_in_generate=True
    )


def _diff(a: Any, b: Any) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.scores, b.scores, strict=True))


def test_lora_is_fused_for_generate_and_restored_bitwise_at_stage_0() -> None:
    pytest.importorskip("transformers")
    from tiny_hf_models import LoraLinear, batch, lora_llama, merged_copy

    model = lora_llama()
    merged, unfused = merged_copy(model), copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = make_engine(model, _hybrid(release_inference_cache=True))
    assert model.generate == engine.generate  # DeepSpeed-Chat calls engine.module.generate
    ids = batch(4, size=2, seq=5)
    got = _generate(model.generate, ids)
    assert _diff(got, _generate(merged.generate, ids)) == 0.0
    assert 0.0 < _diff(got, _generate(unfused.generate, ids)) < 1e-4
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    loras = [m for m in model.modules() if isinstance(m, LoraLinear)]
    assert len(engine.all_lora_params) == 2 * len(loras) == 16
    assert all("forward" not in m.__dict__ and m.fuse_lora is False for m in loras) and not engine.is_lora_fused

    engine.fuse_lora_weight()
    assert engine.is_lora_fused and all(m.fuse_lora is True for m in loras)
    with pytest.raises(RuntimeError, match=r"already fused"):
        engine.fuse_lora_weight()
    engine.unfuse_lora_weight()
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_lora_factors_that_do_not_fit_the_weight_are_named() -> None:
    pytest.importorskip("transformers")
    from tiny_hf_models import lora_llama

    model = lora_llama()
    layer = model.model.layers[1].self_attn.v_proj
    layer.lora_left_weight = torch.nn.Parameter(torch.zeros(4, 7))
    before = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    engine = make_engine(model, _hybrid())
    with pytest.raises(ValueError, match=r"LoRA layer 'model.layers.1.self_attn.v_proj': .*\(4, 7\) do not fit"):
        engine.fuse_lora_weight()
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight, before)  # the layers fused first are undone
    assert "forward" not in model.model.layers[0].self_attn.q_proj.__dict__ and not engine.is_lora_fused
