"""DeepSpeed's AutoTP and inference import paths under ds_engine give ds-parallel's and ds-engine's own objects."""

from __future__ import annotations

import importlib

import pytest
import torch

import ds_engine


def test_module_inject_paths_are_ds_parallels_objects() -> None:
    tensor = pytest.importorskip("ds_parallel", reason="needs ds-parallel: pip install 'ds-engine[parallel]'").tensor
    layers = importlib.import_module("ds_engine.module_inject.layers")
    module_inject = importlib.import_module("ds_engine.module_inject")
    assert layers.LinearAllreduce is tensor.LinearAllreduce and layers.LinearLayer is tensor.LinearLayer
    assert module_inject.set_autotp_mode is tensor.set_autotp_mode is ds_engine.set_autotp_mode


def test_tp_plan_converter_and_auto_tp_config_names() -> None:
    tensor = pytest.importorskip("ds_parallel", reason="needs ds-parallel: pip install 'ds-engine[parallel]'").tensor
    converter = importlib.import_module("ds_engine.module_inject.tp_plan_converter")
    auto_tp = importlib.import_module("ds_engine.module_inject.auto_tp")
    assert (auto_tp.AutoTPConfig, auto_tp.TPLayerSpec) == (tensor.AutoTPConfig, tensor.TPLayerSpec)
    assert auto_tp.PartitionType is tensor.PartitionType and converter.SUPPORTED_STYLES == set(tensor.PLAN_STYLES)
    plan = {"layers.*.q_proj": "colwise_rep", "layers.*.o_proj": "rowwise"}
    assert converter.TPPlanConverter.convert(plan) == tensor.plan_to_layer_specs(plan)
    assert converter.TPPlanConverter._wildcard_to_regex("a.*") == tensor.plan_wildcard_regex("a.*")


def test_inference_paths() -> None:
    engine_mod = importlib.import_module("ds_engine.inference.engine")
    config_mod = importlib.import_module("ds_engine.inference.config")
    assert ds_engine.InferenceEngine is engine_mod.InferenceEngine
    assert ds_engine.DeepSpeedInferenceConfig is config_mod.DeepSpeedInferenceConfig
    assert callable(ds_engine.init_inference) and callable(ds_engine.tp_model_init)


def test_auto_tp_static_helpers_read_ds_parallels_policy() -> None:
    tensor = pytest.importorskip("ds_parallel", reason="needs ds-parallel: pip install 'ds-engine[parallel]'").tensor
    pytest.importorskip("transformers")
    from tiny_hf_models import build

    auto_tp = importlib.import_module("ds_engine.module_inject.auto_tp")
    AutoTP = auto_tp.AutoTP
    llama, gpt2 = build("llama", kv_heads=2), build("gpt2")
    block = type(llama.model.layers[0])
    assert AutoTP.tp_parser(llama) == [(block, ["mlp.down_proj", "self_attn.o_proj"])]
    assert AutoTP.supported(llama) and not AutoTP.supported(gpt2)
    assert [type(m) for m in AutoTP.get_module_list(llama)] == [block]
    assert AutoTP.in_module_list(llama.model.layers[1], AutoTP.get_module_list(llama))
    assert not AutoTP.in_module_list(llama.model.norm, AutoTP.get_module_list(llama))
    assert not AutoTP.kernel_supported(AutoTP.get_module_list(llama))
    policies = AutoTP.update_policy_list([], llama.model.layers[0], [".o_proj"])
    assert AutoTP.update_policy_list(policies, llama.model.layers[1], [".down_proj"]) == [
        (block, {".o_proj", ".down_proj"})
    ]
    with pytest.raises(ValueError, match="AutoTP does not support gpt2 models"):
        AutoTP.tp_parser(gpt2)
    with pytest.raises(TypeError, match="ds_parallel.tensor.shard_model"):
        AutoTP(llama, (), "", None, None, None)
    assert tensor.find_block_policies(llama)[0].row_parallel == {"mlp.down_proj", "self_attn.o_proj"}


def test_runtime_tensor_parallel_paths() -> None:
    tensor = pytest.importorskip("ds_parallel", reason="needs ds-parallel: pip install 'ds-engine[parallel]'").tensor
    tp = importlib.import_module("ds_engine.runtime.tensor_parallel")
    config = importlib.import_module("ds_engine.runtime.tensor_parallel.config")
    manager = importlib.import_module("ds_engine.runtime.tensor_parallel.tp_manager")
    assert tp.AUTOTP_MODE is config.AUTOTP_MODE is tensor.AutoTPMode
    assert tp.TpTrainingManager is manager.TpTrainingManager
    from ds_engine.config._tensor_parallel import TensorParallelConfig, TPConfig

    assert config.TPTrainingConfig is TensorParallelConfig and config.TPConfig is TPConfig
    section = tp.get_tensor_parallel_config({"tensor_parallel": {"autotp_size": 2, "tp": {"tp_grain_size": 8}}})
    assert (section.autotp_size, section.tensor_parallel.tp_grain_size) == (2, 8)
    assert tp.get_tensor_parallel_config({}).autotp_size == 0
    with pytest.raises(ValueError, match="tp_size must be a positive int"):
        tp.TpTrainingManager(torch.nn.Linear(2, 2), 0, torch.float32)
