"""`DeepSpeedInferenceConfig` / `init_inference` argument handling on one process: DeepSpeed's keys and
aliases, the deprecated `mp_size`, clear refusals (kernel injection, int8, unknown keys, conflicts), and one
warning per key that has no effect here."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

import ds_engine as deepspeed
from ds_comm import ConfigDeprecationWarning, ConfigError, validate_section
from ds_engine.inference import DeepSpeedInferenceConfig


def cfg(**data: object) -> DeepSpeedInferenceConfig:
    return validate_section(DeepSpeedInferenceConfig, data)


def test_defaults_and_aliases() -> None:
    c = cfg()
    assert c.dtype == torch.float16 and c.tensor_parallel.tp_size == 1 and c.tensor_parallel.tp_grain_size == 64
    c = cfg(tp={"tp_size": 2}, dtype="bf16", max_tokens=32, kernel_inject=False)
    assert (c.tensor_parallel.tp_size, c.dtype, c.max_out_tokens) == (2, torch.bfloat16, 32)


def test_mp_size_is_deprecated_and_mapped() -> None:
    with pytest.warns(ConfigDeprecationWarning, match="mp_size"):
        assert cfg(mp_size=2).tensor_parallel.tp_size == 2


def test_kernel_injection_is_refused_with_the_alternative() -> None:
    with pytest.raises(ConfigError, match=r"replace_with_kernel_inject: .*not implemented in ds.*tp_size"):
        cfg(replace_with_kernel_inject=True)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"dtype": "int8"}, "int8 needs inference quantization"),
        ({"dtype": "fp8"}, "'fp8' is not a dtype name"),
        ({"tensor_parallel": {"tp_sise": 2}}, "tensor_parallel.tp_sise: unknown key 'tp_sise'; did you mean 'tp_size'"),
        ({"enable_cuda_graph": True}, "enable_cuda_graph.*CUDA graph capture is not implemented"),
        ({"tensor_parallel": {"tp_size": 0}}, "tensor_parallel.tp_size"),
    ],
)
def test_bad_settings_name_the_key(data: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        cfg(**data)


def test_init_inference_merges_config_and_kwargs() -> None:
    model = nn.Linear(4, 4)
    engine = deepspeed.init_inference(model, config={"dtype": torch.float32}, max_out_tokens=8)
    assert engine.module is model and model.weight.dtype == torch.float32
    torch.testing.assert_close(engine(torch.ones(1, 4)), model(torch.ones(1, 4)))
    with pytest.raises(ValueError, match="Conflicting argument 'dtype'"):
        deepspeed.init_inference(model, config={"dtype": torch.float32}, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="'config' must be a path or a dict, got int"):
        deepspeed.init_inference(model, config=3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"triangular_masking": False}, r"^triangular_masking=False has no effect in ds \(only DeepSpeed's injected"),
        ({"tm": False}, r"^triangular_masking=False has no effect in ds"),
        ({"min_tokens": 4}, r"^min_out_tokens=4 has no effect in ds"),
        ({"use_triton": True}, r"^use_triton=True has no effect in ds \(only DeepSpeed's injected inference kernels"),
        ({"quant": {"enabled": False}}, r"^quant=\{'enabled': False\} has no effect in ds \(DeepSpeed reads it only"),
        ({"zero": {"stage": 3}}, r"^zero=\{'stage': 3\} has no effect in ds \(DeepSpeed's inference engine does not"),
        ({"tensor_parallel": {"enabled": False}}, r"^tensor_parallel.enabled=False has no effect in ds \(DeepSpeed"),
    ],
)
def test_keys_without_effect_warn_once_naming_the_key(kwargs: dict[str, object], message: str) -> None:
    model = nn.Linear(4, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        deepspeed.init_inference(model, dtype=torch.float32, **kwargs)
    shown = [str(w.message) for w in caught if w.category is UserWarning]
    assert len(shown) == 1 and re.match(message, shown[0]), shown
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the defaults spelled out: silent
        deepspeed.init_inference(model, dtype=torch.float32, triangular_masking=True, return_tuple=True, zero={})
