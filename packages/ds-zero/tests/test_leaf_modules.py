"""The ZeRO-3 leaf-module flags (DeepSpeed's `deepspeed.utils.z3_leaf_module` API) and the `leaf_module` section."""

from __future__ import annotations

import pytest
from torch import nn

import ds_zero
from ds_zero import ZeroConfig
from ds_zero._schedule.leaf_modules import apply_leaf_module_config


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.Linear(2, 2)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.ModuleDict({"mlp": Experts(), "attn": nn.Linear(2, 2)}) for _ in range(2)])


def test_set_get_unset_by_class_and_class_name() -> None:
    model = Model()
    assert ds_zero.get_z3_leaf_modules(model) == []
    flagged = ds_zero.set_z3_leaf_modules(model, [Experts])
    assert flagged == [layer["mlp"] for layer in model.layers]
    assert ds_zero.get_z3_leaf_modules(model) == flagged
    assert all(ds_zero.z3_leaf_module(m) for m in flagged) and not ds_zero.z3_leaf_module(model)
    ds_zero.unset_z3_leaf_modules(model, ["Experts"])  # a bare class name
    assert ds_zero.get_z3_leaf_modules(model) == []
    qualified = f"{Experts.__module__}.{Experts.__qualname__}"
    assert ds_zero.set_z3_leaf_modules(model, [qualified]) == flagged


def test_no_match_raises_unless_told_not_to() -> None:
    model = Model()
    with pytest.raises(ValueError, match="no modules of type"):
        ds_zero.set_z3_leaf_modules(model, [nn.Conv2d])
    assert ds_zero.set_z3_leaf_modules(model, [nn.Conv2d], raise_if_not_found=False) == []
    with pytest.raises(TypeError, match="list of module classes"):
        ds_zero.set_z3_leaf_modules(model, [3])  # type: ignore[list-item]


def test_by_name_and_by_suffix() -> None:
    model = Model()
    found, missing = ds_zero.set_z3_leaf_modules_by_name(model, ["layers.0.mlp", "nope"], raise_if_not_found=False)
    assert found == [model.layers[0]["mlp"]] and missing == ["nope"]
    with pytest.raises(ValueError, match="no modules named"):
        ds_zero.set_z3_leaf_modules_by_name(model, ["nope"])
    found, missing = ds_zero.set_z3_leaf_modules_by_suffix(model, ["attn", "zzz"], raise_if_not_found=False)
    assert found == [model.layers[0]["attn"], model.layers[1]["attn"]] and missing == ["zzz"]
    found, _ = ds_zero.set_z3_leaf_modules_by_suffix(model, ["attn"], flag=False)
    assert ds_zero.get_z3_leaf_modules(model) == [model.layers[0]["mlp"]]


def test_leaf_module_section_defaults_and_coercion() -> None:
    default = ZeroConfig(stage=3).leaf_module
    assert default.classes[0] == "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock"
    assert default.names == [] and default.name_suffixes == []
    cfg = ZeroConfig(stage=3, leaf_module={"classes": "Experts", "names": ["a", "a"]}).leaf_module
    assert cfg.classes == ["Experts"] and cfg.names == ["a"]
    with pytest.raises(ValueError, match="did you mean 'classes'"):
        ZeroConfig(stage=3, leaf_module={"clases": []})


def test_apply_section_flags_each_module_once() -> None:
    model = Model()
    cfg = ZeroConfig(stage=3, leaf_module={"classes": ["Experts"], "names": ["layers.0.mlp"], "name_suffixes": ["mlp"]})
    flagged = apply_leaf_module_config(model, cfg.leaf_module)
    assert flagged == [model.layers[0]["mlp"], model.layers[1]["mlp"]]
    assert apply_leaf_module_config(Model(), ZeroConfig(stage=3).leaf_module) == []  # defaults: no HF MoE here
