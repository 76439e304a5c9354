"""DeepSpeed's AutoTP and inference import paths under ds_engine give ds-parallel's and ds-engine's own objects."""

from __future__ import annotations

import importlib

import pytest

import ds_engine


def test_module_inject_paths_are_ds_parallels_objects() -> None:
    tensor = pytest.importorskip("ds_parallel", reason="needs ds-parallel: pip install 'ds-engine[parallel]'").tensor
    layers = importlib.import_module("ds_engine.module_inject.layers")
    module_inject = importlib.import_module("ds_engine.module_inject")
    assert layers.LinearAllreduce is tensor.LinearAllreduce and layers.LinearLayer is tensor.LinearLayer
    assert module_inject.set_autotp_mode is tensor.set_autotp_mode is ds_engine.set_autotp_mode


def test_inference_paths() -> None:
    engine_mod = importlib.import_module("ds_engine.inference.engine")
    config_mod = importlib.import_module("ds_engine.inference.config")
    assert ds_engine.InferenceEngine is engine_mod.InferenceEngine
    assert ds_engine.DeepSpeedInferenceConfig is config_mod.DeepSpeedInferenceConfig
    assert callable(ds_engine.init_inference) and callable(ds_engine.tp_model_init)
