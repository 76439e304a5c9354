"""Reading a Hugging Face tensor-parallel plan and resolving it against a model (single process).

The merge rules are DeepSpeed 0.19.8's `_get_hf_tp_plan`; the pattern rules its `TPPlanConverter`'s.
"""

from __future__ import annotations

import types

import pytest
from torch import nn

from ds_parallel.tensor import (
    PLAN_STYLES,
    AutoTPConfig,
    PartitionType,
    PlanStyle,
    extract_hf_tp_plan,
    plan_pattern,
    plan_to_layer_specs,
    plan_wildcard_regex,
    resolve_plan,
    resolve_specs,
)

# -- extraction --------------------------------------------------------------------------------------


def _model(config_plan: object = None, class_plan: object = None, instance_plan: object = "absent") -> object:
    namespace = {} if class_plan is None else {"_tp_plan": class_plan}
    obj = type("Wrapper", (), namespace)()
    if config_plan is not None:
        obj.config = types.SimpleNamespace(base_model_tp_plan=config_plan)
    if instance_plan != "absent":
        obj._tp_plan = instance_plan
    return obj


def test_no_plan_anywhere_is_none() -> None:
    assert extract_hf_tp_plan(nn.Linear(3, 3)) is None
    assert extract_hf_tp_plan(_model()) is None
    assert extract_hf_tp_plan(object()) is None  # no __dict__ at all


def test_each_source_alone() -> None:
    assert extract_hf_tp_plan(_model(config_plan={"h.*.fc": "colwise"})) == {"h.*.fc": "colwise"}
    assert extract_hf_tp_plan(_model(class_plan={"head": "colwise_rep"})) == {"head": "colwise_rep"}
    assert extract_hf_tp_plan(_model(instance_plan={"h.*.out": "rowwise"})) == {"h.*.out": "rowwise"}


def test_empty_and_non_dict_sources_are_ignored() -> None:
    assert extract_hf_tp_plan(_model(instance_plan={})) is None
    assert extract_hf_tp_plan(_model(config_plan={"a": "colwise"}, instance_plan=None)) == {"a": "colwise"}
    assert extract_hf_tp_plan(_model(config_plan=["a"], class_plan="b", instance_plan=("c",))) is None


def test_sources_merge_in_order_config_class_instance_later_wins() -> None:
    plan = extract_hf_tp_plan(
        _model(
            config_plan={"blocks.*.up": "colwise", "blocks.*.down": "rowwise"},
            class_plan={"head": "colwise_rep", "blocks.*.down": "colwise"},
            instance_plan={"head": "colwise_gather_output", "norm": "replicated_with_grad_allreduce"},
        )
    )
    assert plan == {
        "blocks.*.up": "colwise",
        "blocks.*.down": "colwise",
        "head": "colwise_gather_output",
        "norm": "replicated_with_grad_allreduce",
    }
    assert list(plan) == ["blocks.*.up", "blocks.*.down", "head", "norm"]  # first insertion keeps its place


def test_prefixed_duplicate_of_a_known_entry_is_dropped_but_new_prefixed_entries_kept() -> None:
    plan = extract_hf_tp_plan(
        _model(
            config_plan={"blocks.*.up": "colwise"},
            instance_plan={"model.blocks.*.up": "rowwise", "model.emb": "embedding_rowwise"},
        )
    )
    assert plan == {"blocks.*.up": "colwise", "model.emb": "embedding_rowwise"}


def test_class_head_entry_survives_an_instance_plan_that_replaced_it() -> None:
    model = _model(
        config_plan={"blocks.*.up": "colwise"},
        class_plan={"head": "colwise_gather_output"},
        instance_plan={"model.blocks.*.up": "colwise"},
    )
    assert extract_hf_tp_plan(model) == {"blocks.*.up": "colwise", "head": "colwise_gather_output"}


def test_unprefixed_after_prefixed_is_kept_both() -> None:
    # only a `model.` entry seen after its bare form is dropped; the reverse order keeps both
    plan = extract_hf_tp_plan(_model(config_plan={"model.x": "colwise"}, instance_plan={"x": "rowwise"}))
    assert plan == {"model.x": "colwise", "x": "rowwise"}


def test_extraction_does_not_modify_the_sources() -> None:
    config_plan = {"a": "colwise"}
    model = _model(config_plan=config_plan, instance_plan={"model.a": "rowwise"})
    plan = extract_hf_tp_plan(model)
    assert plan is not None
    plan["b"] = "rowwise"
    assert config_plan == {"a": "colwise"} and model._tp_plan == {"model.a": "rowwise"}  # type: ignore[attr-defined]


def test_hf_llama_plan_merges_base_head_and_embedding() -> None:
    pytest.importorskip("transformers")
    from tiny_hf import build

    plan = extract_hf_tp_plan(build("llama"))
    assert plan is not None
    assert plan["layers.*.self_attn.q_proj"] == "colwise" and plan["layers.*.mlp.down_proj"] == "rowwise"
    assert plan["lm_head"] == "colwise_gather_output"
    assert not any(p.startswith("model.layers") for p in plan)  # the instance's prefixed copies dropped


# -- patterns and resolution -------------------------------------------------------------------------


def test_pattern_regex() -> None:
    regex = plan_pattern("layers.*.attn.q")
    assert regex.match("model.layers.3.attn.q.weight")
    assert not regex.match("model.layers.3.attn.q.bias")
    assert not regex.match("model.layers.3.attnXq.weight")  # dots are literal
    assert not regex.match("model.layers.3.attn.qk.weight")
    assert plan_pattern("head.weight").match("head.weight")


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.norm = nn.LayerNorm(8)


class _Net(nn.Module):
    def __init__(self, tie: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.head = nn.Linear(8, 10, bias=False)
        if tie:
            self.head.weight = self.emb.weight


_MIXED_PLAN = {
    "blocks.1.up": "rowwise",  # first match wins over the wildcard below
    "blocks.*.up": "colwise",
    "blocks.*.down": "RowWise",  # styles are case-insensitive
    "head": "colwise_rep",
    "emb": "embedding_rowwise",
    "blocks.*.norm": "replicated_with_grad_allreduce",
}


def test_resolve_picks_styles_first_match_and_leaves_the_rest() -> None:
    resolved = resolve_plan(_Net(), _MIXED_PLAN)
    assert resolved.layers == {
        "blocks.0.up": PlanStyle.COLUMN,
        "blocks.0.down": PlanStyle.ROW,
        "blocks.1.up": PlanStyle.ROW,
        "blocks.1.down": PlanStyle.ROW,
        "head": PlanStyle.COLUMN_GATHER,
    }
    assert resolved.grad_allreduce == ("blocks.0.norm.weight", "blocks.1.norm.weight")


def test_unsupported_style_is_refused_naming_module_and_style() -> None:
    with pytest.raises(ValueError, match=r"'blocks\.\*\.up' \(matching module 'blocks\.0\.up'\).*'packed_colwise'"):
        resolve_plan(_Net(), {"blocks.*.down": "rowwise", "blocks.*.up": "packed_colwise"})
    with pytest.raises(ValueError, match=r"'nothing' \(matching no module of the model\).*'local'"):
        resolve_plan(_Net(), {"nothing": "local"})
    assert "sequence_parallel" not in PLAN_STYLES


def test_cutting_a_non_linear_or_a_tied_weight_is_refused() -> None:
    with pytest.raises(ValueError, match=r"cuts 'emb' \(Embedding\) with style 'colwise'"):
        resolve_plan(_Net(), {"emb": "colwise"})
    with pytest.raises(ValueError, match=r"cuts 'head' with style 'rowwise'.*shared with \['emb'\]"):
        resolve_plan(_Net(tie=True), {"head": "rowwise"})


def test_gathered_head_tied_to_the_embedding_stays_whole() -> None:
    resolved = resolve_plan(_Net(tie=True), {"head": "colwise_gather_output", "blocks.*.up": "colwise"})
    assert resolved.layers == {"blocks.0.up": PlanStyle.COLUMN, "blocks.1.up": PlanStyle.COLUMN}


# -- the plan as DeepSpeed's layer specs (TPPlanConverter) ----------------------------------------------


def test_layer_specs_cut_what_the_plan_cuts() -> None:
    specs = plan_to_layer_specs(_MIXED_PLAN)
    assert specs is not None and len(specs) == len(_MIXED_PLAN)
    by_specs = resolve_specs(_Net(), AutoTPConfig(layer_specs=specs))
    by_plan = resolve_plan(_Net(), _MIXED_PLAN)
    as_style = {
        (PartitionType.COLUMN, False): PlanStyle.COLUMN,
        (PartitionType.COLUMN, True): PlanStyle.COLUMN_GATHER,
        (PartitionType.ROW, False): PlanStyle.ROW,
    }
    assert {
        name: as_style[(s.partition_type, s.gather_output)] for name, s in by_specs.layers.items()
    } == by_plan.layers
    assert by_specs.grad_allreduce == by_plan.grad_allreduce
    kept = [s for s in specs if s.partition_type is PartitionType.SKIP]
    assert [(s.patterns, s.grad_allreduce) for s in kept] == [
        ([r".*emb\.weight$"], False),
        ([r".*blocks\..*\.norm\.weight$"], True),
    ]


def test_layer_specs_of_an_empty_or_unsupported_plan() -> None:
    assert plan_to_layer_specs({}) is None
    with pytest.raises(ValueError, match=r"unsupported partition style\(s\) \['local', 'packed'\]"):
        plan_to_layer_specs({"a": "colwise", "b": "packed", "c": "local"})
    assert plan_wildcard_regex("layers.*.q_proj") == r".*layers\..*\.q_proj"
    assert plan_to_layer_specs({"head.weight": "rowwise"})[0].patterns == [r".*head\.weight$"]  # type: ignore[index]
