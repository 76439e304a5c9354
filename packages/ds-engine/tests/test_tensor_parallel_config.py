"""The `tensor_parallel` section and `tp_model_init` on one process: DeepSpeed's keys, and the refusals
(unimplemented options, a malformed partition_config or unknown preset,
a size that disagrees with tp_model_init), each naming the key, before any group is built. fp16 and
gradient clipping are accepted (tests/dist/test_dist_autotp_clipping.py trains with them)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import ds_engine as deepspeed
from ds_engine.config import DeepSpeedConfig, DeepSpeedConfigError

pytest.importorskip("ds_parallel", reason="AutoTP needs ds-parallel: pip install 'ds-engine[parallel]'")

BASE: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_clipping": 0.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
}


def test_section_keys() -> None:
    c = DeepSpeedConfig({**BASE, "tensor_parallel": {"autotp_size": 2, "tp": {"tp_grain_size": 8}}}, world_size=1)
    tp = c.parsed.tensor_parallel
    assert (tp.autotp_size, tp.tensor_parallel.tp_grain_size, tp.enabled) == (2, 8, True)
    assert not DeepSpeedConfig(BASE, world_size=1).parsed.tensor_parallel.enabled


@pytest.mark.parametrize(
    ("section", "match"),
    [
        ({"autotp_size": 2, "tp_overlap_comm": True}, "overlapping the tensor-parallel all-reduce"),
        ({"autotp_sise": 2}, "tensor_parallel.autotp_sise: unknown key 'autotp_sise'; did you mean 'autotp_size'"),
        ({"autotp_size": -1}, "tensor_parallel.autotp_size"),
    ],
)
def test_bad_section_names_the_key(section: dict[str, Any], match: str) -> None:
    with pytest.raises(DeepSpeedConfigError, match=match):
        DeepSpeedConfig({**BASE, "tensor_parallel": section}, world_size=1)


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (
            {
                "tensor_parallel": {
                    "autotp_size": 2,
                    "partition_config": {"layer_specs": [{"patterns": ["x"], "partition_type": "rows"}]},
                }
            },
            r"tensor_parallel.partition_config.layer_specs\[0\].partition_type: 'rows' is not one of column, row",
        ),
        (
            {"tensor_parallel": {"autotp_size": 2, "partition_config": {"layer_specs": [{"pattern": ["x"]}]}}},
            "tensor_parallel.partition_config.layer_specs\\[0\\]: unknown key\\(s\\) \\['pattern'\\]",
        ),
        (
            {"tensor_parallel": {"autotp_size": 2, "preset_model": "gpt9"}},
            "tensor_parallel.preset_model: 'gpt9' is not one of llama",
        ),
    ],
)
def test_combinations_tensor_parallelism_refuses(extra: dict[str, Any], match: str) -> None:
    config = {**BASE, "tensor_parallel": {"autotp_size": 2}, **extra}
    with pytest.raises(DeepSpeedConfigError, match=match):
        deepspeed.initialize(model=nn.Linear(4, 4), config=config, dist_init_required=False)


@pytest.fixture(autouse=True)
def _no_record_left() -> Any:
    """A `tp_model_init` record lives until the next initialize() consumes it: never leak one to other tests."""
    yield
    from ds_engine._parallel import tp_model_init as _tp_model_init
    from ds_parallel.tensor import set_autotp_mode

    _tp_model_init._RECORD.clear()
    set_autotp_mode(training=False)


def test_tp_model_init_records_and_must_agree() -> None:
    model = nn.Linear(4, 4)
    assert deepspeed.tp_model_init(model, tp_size=2, dtype=torch.float32) is model
    from ds_parallel.tensor import is_autotp_training_mode, set_autotp_mode

    assert is_autotp_training_mode()
    set_autotp_mode(training=False)
    config = {**BASE, "tensor_parallel": {"autotp_size": 4}}
    with pytest.raises(DeepSpeedConfigError, match="autotp_size=4 but tp_model_init recorded tp_size=2"):
        deepspeed.initialize(model=model, config=config, dist_init_required=False)
    with pytest.raises(ValueError, match="tp_size must be a positive int, got 0"):
        deepspeed.tp_model_init(model, tp_size=0, dtype=torch.float32)
    deepspeed.tp_model_init(model, tp_size=2, dtype=torch.float32)
    with pytest.raises(ValueError, match="conflicting arguments across calls"):
        deepspeed.tp_model_init(model, tp_size=2, dtype=torch.bfloat16)


def test_autotp_config_module_path_is_ds_parallels() -> None:
    from ds_engine.module_inject.autotp_config import AutoTPConfig, AutoTPPresets, merge_autotp_configs
    from ds_parallel.tensor import AutoTPConfig as Same

    assert AutoTPConfig is Same and callable(merge_autotp_configs)
    assert AutoTPPresets.get_preset("qwen2") is not None
