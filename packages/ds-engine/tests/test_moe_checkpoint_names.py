"""DeepSpeed's expert-file helpers on the engine: `_get_expert_ckpt_name` and `load_moe_state_dict`'s checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from torch import nn

from ds_engine import DeepSpeedEngine


class _Mpu:
    def get_model_parallel_rank(self) -> int:
        return 3


def test_expert_file_names_follow_the_layer_expert_and_model_parallel_rank() -> None:
    name = DeepSpeedEngine._get_expert_ckpt_name
    assert name("/ckpt", 1, 2, "t") == str(Path("/ckpt/t/layer_1_expert_2_mp_rank_00_model_states.pt"))
    assert name("/ckpt", 1, 2, "t", _Mpu()).endswith("layer_1_expert_2_mp_rank_03_model_states.pt")
    assert name("/ckpt", 1, 2, "t", _Mpu(), checkpoint_mp_rank=0).endswith(
        "layer_1_expert_2_mp_rank_00_model_states.pt"
    )
    assert name("/ckpt", -1, 5, "t") == str(Path("/ckpt/t/expert_5_mp_rank_00_model_states.pt"))  # DeepSpeed's old name
    assert name("/ckpt", 0, 0, None) == str(Path("/ckpt/layer_0_expert_0_mp_rank_00_model_states.pt"))


def _entry(layer: int, **changes: Any) -> dict[str, Any]:
    entry = {
        "moe_layer_id": layer,
        "module_path": f"layers.{layer}.mlp",
        "num_experts": 4,
        "num_local_experts": 2,
        "ep_size": 2,
        "expert_key_prefix": f"layers.{layer}.mlp.experts",
    }
    entry.update(changes)
    return entry


@pytest.mark.parametrize(
    ("layers", "match"),
    [
        ("not_a_list", "malformed: expected list"),
        ([["moe_layer_id", 0]], "entry is malformed: expected dict"),
        ([{"moe_layer_id": 0}], r"missing fields \['ep_size', 'expert_key_prefix', 'module_path'"),
        ([_entry(0), _entry(0, expert_key_prefix="other")], "duplicate moe_layer_id: 0"),
        ([_entry(0), _entry(1, expert_key_prefix="layers.0.mlp.experts")], "duplicate expert_key_prefix"),
    ],
)
def test_load_moe_state_dict_checks_the_autoep_layer_entries_as_deepspeed_does(layers: Any, match: str) -> None:
    with pytest.raises(RuntimeError, match=match):
        DeepSpeedEngine.load_moe_state_dict(
            "/nowhere", "t", {}, old_moe_load=False, model=nn.Linear(1, 1), autoep_layers=layers
        )


def test_load_moe_state_dict_of_a_model_without_moe_layers_loads_nothing(caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("ds_parallel")  # MoE layers are ds-parallel's: without it the lookup names the extra
    state: dict[str, Any] = {"weight": 1}
    with caplog.at_level("WARNING"):
        DeepSpeedEngine.load_moe_state_dict(
            "/nowhere", "t", state, old_moe_load=False, model=nn.Linear(1, 1), mpu=_Mpu(), autoep_layers=[_entry(0)]
        )
    assert state == {"weight": 1}
    assert "no MoE layers" in caplog.text
