"""Configurable AutoTP specs on one process: parsing (errors name the key path), presets and their merge,
and what `resolve_specs` decides for a model (first match wins, unmatched layers whole or refused under
`strict_mode`, embeddings whole, `model_types`, ties, `grad_allreduce`)."""

from __future__ import annotations

import pytest
from torch import nn

from ds_parallel.tensor import (
    AutoTPConfig,
    AutoTPPresets,
    PartitionType,
    TPLayerSpec,
    merge_autotp_configs,
    partition_config_from_settings,
    resolve_specs,
)


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(8, 8) for _ in range(4))
        self.q_norm = nn.LayerNorm(8)


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn, self.mlp = Attn(), Mlp()


class TinyLlama(nn.Module):
    def __init__(self, tie: bool = False) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(32, 8)
        self.layers = nn.ModuleList([Layer(), Layer()])
        self.lm_head = nn.Linear(8, 32, bias=False)
        if tie:
            self.lm_head.weight = self.embed_tokens.weight


def _kinds(model: nn.Module, config: AutoTPConfig) -> dict[str, str]:
    return {path: spec.partition_type.value for path, spec in resolve_specs(model, config).layers.items()}


def test_llama_preset_cuts_attention_and_mlp_and_leaves_the_rest_whole() -> None:
    kinds = _kinds(TinyLlama(), AutoTPPresets.get_preset("LLaMA"))
    assert kinds == {
        f"layers.{i}.{name}": kind
        for i in range(2)
        for name, kind in [
            ("self_attn.q_proj", "column"),
            ("self_attn.k_proj", "column"),
            ("self_attn.v_proj", "column"),
            ("self_attn.o_proj", "row"),
            ("mlp.gate_proj", "column"),
            ("mlp.up_proj", "column"),
            ("mlp.down_proj", "row"),
        ]
    }


def test_custom_specs_go_ahead_of_the_preset_unless_defaults_are_off() -> None:
    custom = {"layer_specs": [{"patterns": [r".*mlp\.down_proj\.weight$"], "partition_type": "skip"}]}
    merged = partition_config_from_settings(custom, "llama", tp_size=2)
    assert merged is not None and merged.tp_size == 2
    assert "layers.0.mlp.down_proj" not in _kinds(TinyLlama(), merged)
    assert _kinds(TinyLlama(), merged)["layers.0.self_attn.o_proj"] == "row"
    alone = partition_config_from_settings({**custom, "use_default_specs": False}, "llama")
    assert alone is not None and _kinds(TinyLlama(), alone) == {}
    base = AutoTPPresets.llama()
    assert merge_autotp_configs(base, AutoTPConfig.from_dict(custom)).layer_specs[1:] == base.layer_specs
    assert partition_config_from_settings(None, None) is None


def test_first_match_wins_and_strict_mode_refuses_unmatched_layers() -> None:
    config = AutoTPConfig.from_dict(
        {
            "layer_specs": [
                {"patterns": [r"layers\.0\..*\.weight$"], "partition_type": "row"},
                {"patterns": [r".*_proj\.weight$"], "partition_type": "column"},
            ]
        }
    )
    kinds = _kinds(TinyLlama(), config)
    assert kinds["layers.0.mlp.up_proj"] == "row" and kinds["layers.1.mlp.up_proj"] == "column"
    assert "lm_head" not in kinds
    config.strict_mode = True
    with pytest.raises(ValueError, match="no tensor_parallel.partition_config layer spec matches 'lm_head.weight'"):
        resolve_specs(TinyLlama(), config)


def test_embeddings_stay_whole_and_a_tied_head_is_refused_unless_gathered() -> None:
    everything = AutoTPConfig.from_dict({"layer_specs": [{"patterns": [r".*\.weight$"]}]})
    assert "embed_tokens" not in _kinds(TinyLlama(), everything)
    with pytest.raises(ValueError, match="'lm_head'.*shared with \\['embed_tokens'\\]"):
        resolve_specs(TinyLlama(tie=True), everything)
    gathered = AutoTPConfig.from_dict({"layer_specs": [{"patterns": ["lm_head.weight"], "gather_output": True}]})
    assert _kinds(TinyLlama(tie=True), gathered) == {}


def test_model_types_limit_a_spec_and_grad_allreduce_names_parameters() -> None:
    model = TinyLlama()
    model.config = type("Cfg", (), {"model_type": "Qwen3"})()
    specs = {
        "layer_specs": [
            {"patterns": [r".*q_norm\.weight$"], "partition_type": "skip", "grad_allreduce": True},
            {"patterns": [r".*q_proj\.weight$"], "model_types": ["llama"]},
            {"patterns": [r".*k_proj\.weight$"], "model_types": ["qwen3"]},
        ]
    }
    resolved = resolve_specs(model, AutoTPConfig.from_dict(specs))
    assert list(resolved.layers) == ["layers.0.self_attn.k_proj", "layers.1.self_attn.k_proj"]
    assert resolved.grad_allreduce == ("layers.0.self_attn.q_norm.weight", "layers.1.self_attn.q_norm.weight")


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"patterns": ["x"], "partition_type": "diagonal"}, r".partition_type: 'diagonal' is not one"),
        ({"patterns": []}, r".patterns: required"),
        ({"patterns": ["("]}, r".patterns: '\(' is not a valid regex"),
        ({"patterns": ["x"], "shape": [3, -1], "partition_dim": 2}, r".partition_dim: 2 is out of range for shape"),
        ({"patterns": ["x"], "shape": [-1, [4, 4]], "partition_dim": 0}, r".shape: a list of sizes is allowed only at"),
        ({"patterns": ["x"], "shape": [[4, 0], -1]}, r".shape: sub-parameter sizes \[4, 0\] must be positive"),
        (
            {"patterns": ["x"], "partition_type": "row", "gather_output": True},
            r".gather_output: only a column cut gathers",
        ),
        ({"patterns": ["x"], "grad_allreduce": True}, r".grad_allreduce: only a skip spec"),
        ({"patterns": ["x"], "partiton_type": "row"}, r": unknown key\(s\) \['partiton_type'\]"),
    ],
)
def test_malformed_specs_are_refused_with_their_key_path(entry: dict, message: str) -> None:
    with pytest.raises(ValueError, match=r"^tensor_parallel\.partition_config\.layer_specs\[0\]" + message):
        AutoTPConfig.from_dict({"layer_specs": [entry]})


def test_spec_helpers_describe_sub_parameters() -> None:
    gqa = AutoTPPresets.llama_gqa(num_heads=8, num_kv_heads=2, head_dim=4).layer_specs[1]
    assert gqa.get_sub_param_sizes() == (32, 8, 8) and gqa.get_num_sub_params() == 3
    assert gqa.has_unequal_sub_params()
    packed = TPLayerSpec(["x"], "column", shape=[2, -1])
    assert packed.get_num_sub_params() == 2 and packed.get_sub_param_sizes() is None
    assert TPLayerSpec(["x"], PartitionType.ROW).get_partition_dim() == 1
    assert TPLayerSpec(["x"]).matches("a.x") is False and TPLayerSpec([".*x"]).matches("a.x")
