"""`ds_zero.Init(config_dict_or_path=...)` with `"auto"` values, as Hugging Face passes the config before training.

transformers builds the model inside `Init` while the model-dependent keys (`reduce_bucket_size`,
`stage3_prefetch_bucket_size`, `stage3_param_persistence_threshold`) and the Trainer-filled ones are
still `"auto"`; DeepSpeed reads them at their defaults there. A non-auto bad value is still an error.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ds_zero
from ds_zero import is_zero_param

HF_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": False},
    "zero_optimization": {
        "stage": 3,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "offload_param": {"device": "cpu", "pin_memory": "auto"},
    },
}


def test_init_reads_auto_values_at_their_defaults() -> None:
    init = ds_zero.Init(config_dict_or_path=HF_CONFIG)
    with init:
        net = nn.Linear(4, 4)
    assert is_zero_param(net.weight) and is_zero_param(net.bias)
    # "auto" is not "enabled": the dtype stays fp32; offload_param.device is read, pin_memory takes its default
    assert net.weight.dtype == torch.float32 and init.dtype is None
    default_pin = ds_zero.OffloadParamConfig().pin_memory
    assert init.shard_device == torch.device("cpu") and init.pin_memory is default_pin


def test_init_still_rejects_bad_concrete_values() -> None:
    bad = {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_max_live_parameters": -1}}
    with pytest.raises(ValueError, match="stage3_max_live_parameters"):
        ds_zero.Init(config_dict_or_path=bad)
