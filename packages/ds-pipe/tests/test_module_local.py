"""PipelineModule in one process: construction errors, forward, per-layer save/load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from ds_pipe import LayerSpec, PartitionMethodError, PipeDataParallelTopology, PipelineModule, TiedLayerSpec


def _layers() -> list:
    return [LayerSpec(nn.Linear, 4, 6), nn.Tanh(), lambda x: x * 2, LayerSpec(nn.Linear, 6, 3)]


def test_forward_runs_the_layers_in_order() -> None:
    module = PipelineModule(_layers(), num_stages=1)
    assert module.partitions() == [0, 4] and module.stage_owner(3) == 0 and module.num_pipeline_stages() == 1
    x = torch.randn(2, 4)
    expected = getattr(module, "3")(torch.tanh(getattr(module, "0")(x)) * 2)
    assert torch.equal(module(x), expected)
    assert module.topology().get_axis_names() == ["pipe", "data"] and module.mpu().get_stage_id() == 0


def test_checkpoint_interval_keeps_the_result() -> None:
    torch.manual_seed(0)
    module = PipelineModule(_layers(), num_stages=1, activation_checkpoint_interval=2)
    x = torch.randn(2, 4)
    out = module(x)
    module.set_checkpoint_interval(0)
    assert torch.equal(out, module(x))


def test_seed_layers_makes_initialisation_independent_of_the_process_rng() -> None:
    torch.manual_seed(1)
    a = PipelineModule(_layers(), num_stages=1, seed_layers=True)
    torch.manual_seed(2)
    b = PipelineModule(_layers(), num_stages=1, seed_layers=True)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=False))
    torch.manual_seed(1234 + 3)
    assert torch.equal(getattr(a, "3").weight, nn.Linear(6, 3).weight)


def test_tied_layers_share_one_module_on_one_stage() -> None:
    layers = [
        TiedLayerSpec("emb", nn.Linear, 3, 3, bias=False),
        nn.Tanh(),
        TiedLayerSpec("emb", nn.Linear, 3, 3, bias=False, forward_fn=lambda m, x: x @ m.weight),
    ]
    module = PipelineModule(layers, num_stages=1)
    assert [n for n, _ in module.named_parameters()] == ["tied_modules.emb.weight"]
    x = torch.randn(2, 3)
    w = module.tied_modules["emb"].weight
    assert torch.allclose(module(x), torch.tanh(x @ w.t()) @ w)
    assert module.get_tied_weights_and_groups() == []  # nothing shared with another stage


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({}, ValueError, "must provide num_stages or topology"),
        ({"num_stages": 2}, ValueError, "num_stages=2 must be an int >= 1 dividing the world size 1"),
        ({"num_stages": 2, "topology": PipeDataParallelTopology(1, 1)}, ValueError, "num_stages=2 disagrees with"),
        (
            {"num_stages": 1, "partition_method": "profile"},
            PartitionMethodError,
            "Partitioning method profile not implemented",
        ),
        ({"num_stages": 1, "partition_method": "type:Conv"}, PartitionMethodError, "matches no layer; layer types are"),
        ({"num_stages": 1, "partition_method": [0, 3]}, ValueError, "explicit partition \\[0, 3\\] must be 2"),
        ({"num_stages": 1, "activation_checkpoint_interval": -1}, ValueError, "activation_checkpoint_interval"),
    ],
)
def test_bad_construction_is_named(kwargs: dict, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        PipelineModule(_layers(), **kwargs)


def test_partition_method_error_is_also_not_implemented_error() -> None:
    with pytest.raises(NotImplementedError):
        PipelineModule(_layers(), num_stages=1, partition_method="profile")


def test_bad_layers_and_specs_are_named() -> None:
    with pytest.raises(TypeError, match="layer 1 must be an nn.Module, LayerSpec, TiedLayerSpec or callable, got int"):
        PipelineModule([nn.Tanh(), 3], num_stages=1)
    with pytest.raises(TypeError, match="typename must be an nn.Module subclass"):
        LayerSpec(torch.tanh)
    with pytest.raises(TypeError, match="key must be a non-empty str"):
        TiedLayerSpec("", nn.Linear, 2, 2)
    module = PipelineModule(_layers(), num_stages=1)
    with pytest.raises(ValueError, match=r"layer 4 is out of range \[0, 4\)"):
        module.stage_owner(4)
    with pytest.raises(ValueError, match="interval must be an int >= 0"):
        module.set_checkpoint_interval(-2)
    assert repr(LayerSpec(nn.Linear, 4, 6, bias=False)) == "Linear(4, 6, bias=False)"
    assert LayerSpec(nn.Linear, 4, 6).count_parameters() == 30


def test_save_and_load_layer_files(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = PipelineModule(_layers(), num_stages=1)
    getattr(module, "0").bias.requires_grad_(False)
    written = module.save_state_dict(tmp_path, exclude_frozen_params=True)
    assert [p.name for p in written] == [
        "layer_00-model_states.pt",
        "layer_01-model_states.pt",
        "layer_03-model_states.pt",
    ]
    assert module.ckpt_layer_path(tmp_path, 3) == str(tmp_path / "layer_03-model_states.pt")
    assert module.ckpt_layer_path_list(tmp_path, 3) == [str(tmp_path / "layer_03-model_states.pt")]
    assert torch.load(written[1], weights_only=True) == {}  # Tanh: an empty dict, as DeepSpeed writes
    assert list(torch.load(written[0], weights_only=True)) == ["weight"]
    torch.manual_seed(1)
    other = PipelineModule(_layers(), num_stages=1)
    other.load_state_dir(tmp_path, strict=False)
    assert torch.equal(getattr(other, "0").weight, getattr(module, "0").weight)
    assert torch.equal(getattr(other, "3").weight, getattr(module, "3").weight)
    with pytest.raises(RuntimeError, match="layer_00-model_states.pt does not match layer 0"):
        other.load_state_dir(tmp_path)  # strict: the frozen bias was not saved
    (tmp_path / "layer_03-model_states.pt").unlink()
    with pytest.raises(FileNotFoundError, match="no checkpoint for layer 3"):
        other.load_state_dir(tmp_path, strict=False)
