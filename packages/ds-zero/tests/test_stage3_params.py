"""A partitioned parameter keeps its full shape, dtype and identity; its shard and metadata are reachable.

Single process (world size 1, no process group): partitioning, release, gather, dtype conversion,
state_dict/load_state_dict, and the errors for misuse.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ds_zero
from ds_zero import GatheredParameters, ZeroParamStatus, is_zero_param
from ds_zero._params.partitioned_param import ZeroParamState, state_of


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3))


def test_released_parameter_answers_full_shape_dtype_numel_and_is_still_the_same_parameter() -> None:
    model = _mlp()
    before = {n: (p, p.shape, p.dtype, p.numel()) for n, p in model.named_parameters()}
    ds_zero.partition_model(model)
    for name, p in model.named_parameters():
        param, shape, dtype, numel = before[name]
        assert p is param and isinstance(p, nn.Parameter) and is_zero_param(p)
        assert p.shape == shape == p.ds_shape and p.dtype == dtype and p.numel() == numel == p.ds_numel
        assert p.ds_status is ZeroParamStatus.NOT_AVAILABLE
        assert p.ds_tensor.numel() == p.ds_numel  # world size 1: the shard is the whole parameter
        assert state_of(p).full_flat.untyped_storage().nbytes() == 0  # the full storage is released
    assert sum(p.numel() for p in model.parameters()) == sum(v[3] for v in before.values())


def test_only_deepspeed_names_sit_on_the_parameter_and_the_rest_is_one_slotted_record() -> None:
    model = _mlp()
    ds_zero.partition_model(model)
    w = model[0].weight
    assert set(vars(w)) == {
        "ds_id",
        "ds_shape",
        "ds_numel",
        "ds_tensor",
        "ds_status",
        "ds_persist",
        "ds_process_group",
        "ds_zero_partition_rank",  # this rank's place in ds_process_group (DeepSpeed sets both at partitioning)
        "ds_zero_partition_world_size",
        "ds_param_type",
        "ds_secondary_tensor",  # hpZ's slice: None without it
        "ds_active_sub_modules",  # a read-only view of the claims in `_ds_state`
        "is_external_param",
        "_ds_state",
        "all_gather",  # DeepSpeed's per-parameter methods (`_params.param_methods`)
        "all_gather_coalesced",
        "partition",
        "partition_numel",
        "ds_summary",
    }
    assert not w.ds_active_sub_modules and w.is_external_param is False
    assert w.ds_secondary_tensor is None
    assert w.ds_param_type is ds_zero.ZeroParamType.PARTITIONED
    st = state_of(w)
    assert isinstance(st, ZeroParamState) and not hasattr(st, "__dict__")
    with pytest.raises(AttributeError):
        st.not_a_field = 1  # slots: a misspelt field fails instead of adding a stray attribute
    assert (st.shard_numel, st.world_size, st.rank, st.active, st.coord, st.swap) == (60, 1, 0, 0, None, None)
    assert st.full.shape == w.ds_shape and st.placeholder.shape == w.ds_shape and st.full_flat.numel() == 60
    with GatheredParameters(w):
        assert w.data.data_ptr() == st.full.data_ptr() and st.full_flat.untyped_storage().nbytes() == 60 * 4
    assert st.full_flat.untyped_storage().nbytes() == 0
    assert repr(st).startswith("ZeroParamState(name=") and "active=0" in repr(st)  # safe while released


def test_ds_summary_describes_the_parameter_as_deepspeeds_does() -> None:
    model = _mlp()
    ds_zero.partition_model(model)
    w = model[0].weight
    summary = w.ds_summary()
    assert summary == {
        "id": w.ds_id,
        "status": "NOT_AVAILABLE",
        "numel": 60,
        "ds_numel": 60,
        "shape": (10, 6),  # ds keeps the logical shape while released (DeepSpeed's is (0,))
        "ds_shape": (10, 6),
        "requires_grad": True,
        "grad_shape": None,
        "persist": False,
        "active_sub_modules": set(),
        "ds_tensor.shape": torch.Size([60]),
    }
    with GatheredParameters(w):
        assert w.ds_summary()["status"] == "AVAILABLE"
    assert w.ds_summary(use_debug_name=True)["id"] == state_of(w).name


def test_released_parameter_reads_nan_and_refuses_writes() -> None:
    model = _mlp()
    ds_zero.partition_model(model)
    w = model[0].weight
    assert torch.isnan(w.sum())
    with pytest.raises(RuntimeError, match="single memory location"):
        with torch.no_grad():
            w.copy_(torch.zeros_like(w))


def test_gathered_parameters_give_full_values_and_modifier_rank_keeps_changes() -> None:
    ref = _mlp()
    model = copy.deepcopy(ref)
    ds_zero.partition_model(model)
    with GatheredParameters(model.parameters()):
        for p, r in zip(model.parameters(), ref.parameters(), strict=True):
            assert p.ds_status is ZeroParamStatus.AVAILABLE
            torch.testing.assert_close(p, r, atol=0, rtol=0)
            with torch.no_grad():
                p.add_(1.0)  # discarded: no modifier_rank
    assert model[0].weight.ds_status is ZeroParamStatus.NOT_AVAILABLE
    with GatheredParameters(model[0].weight, modifier_rank=0):
        with torch.no_grad():
            model[0].weight.mul_(2.0)
    with GatheredParameters(model[0].weight):
        torch.testing.assert_close(model[0].weight, ref[0].weight * 2.0, atol=0, rtol=0)


def test_state_dict_holds_empty_tensors_for_released_parameters_and_full_ones_when_gathered() -> None:
    model = _mlp()
    ds_zero.partition_model(model)
    sd = model.state_dict()
    assert all(v.shape == (0,) for v in sd.values())
    assert all(v is p for v, p in zip(model.state_dict(keep_vars=True).values(), model.parameters(), strict=True))
    with GatheredParameters(model.parameters()):
        assert model.state_dict()["0.weight"].shape == (10, 6)


def test_full_state_dict_loads_into_partitioned_model_and_empty_entries_keep_values() -> None:
    src, dst = _mlp(seed=1), _mlp(seed=2)
    ds_zero.partition_model(dst)
    result = dst.load_state_dict(src.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    assert all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in dst.parameters())
    empty = {k: torch.empty(0) for k in src.state_dict()}
    assert not dst.load_state_dict(empty).missing_keys  # "the values live in the partitions"
    with GatheredParameters(dst.parameters()):
        for p, r in zip(dst.parameters(), src.parameters(), strict=True):
            torch.testing.assert_close(p, r, atol=0, rtol=0)
    with pytest.raises(RuntimeError, match="size mismatch"):
        dst.load_state_dict({**src.state_dict(), "0.weight": torch.zeros(3, 3)})


def test_to_dtype_converts_shards_without_gathering() -> None:
    ref = _mlp()
    model = copy.deepcopy(ref)
    ds_zero.partition_model(model)
    model.to(torch.bfloat16)
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        assert p.dtype == torch.bfloat16 and p.ds_tensor.dtype == torch.bfloat16 and p.shape == r.shape
        assert p.ds_status is ZeroParamStatus.NOT_AVAILABLE
    with GatheredParameters(model.parameters()):
        torch.testing.assert_close(model[2].bias, ref[2].bias.to(torch.bfloat16), atol=0, rtol=0)


def test_init_context_partitions_as_modules_are_built_and_restores_torch_after() -> None:
    init_before = nn.Linear.__init__
    apply_before = nn.Module.apply

    class Net(nn.Module):  # defined inside the context: wrapped through __init_subclass__
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 2)
            self.apply(self._init)

        @staticmethod
        def _init(m: nn.Module) -> None:
            if isinstance(m, nn.Linear):
                nn.init.constant_(m.weight, 0.25)

    with ds_zero.Init():
        net = Net()
        assert all(is_zero_param(p) for p in net.parameters())
    assert nn.Linear.__init__ is init_before and nn.Module.apply is apply_before
    assert not is_zero_param(nn.Linear(2, 2).weight)
    with GatheredParameters(net.parameters()):
        assert bool((net.a.weight == 0.25).all()) and bool((net.b.weight == 0.25).all())


def test_init_dtype_and_config_dtype() -> None:
    with ds_zero.Init(dtype=torch.bfloat16):
        a = nn.Linear(3, 3)
    with ds_zero.Init(config_dict_or_path={"bf16": {"enabled": True}}):
        b = nn.Linear(3, 3)
    assert a.weight.dtype == b.weight.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("config", "dtype"),
    [
        ({"bf16": {"enabled": True}}, torch.bfloat16),
        ({"bfloat16": {"enabled": True}}, torch.bfloat16),  # the legacy section name, as DeepSpeed reads it
        ({"fp16": {"enabled": True}}, torch.float16),
        ({"bfloat16": {"enabled": False}}, torch.float32),
    ],
)
def test_init_dtype_from_the_precision_sections(config: dict, dtype: torch.dtype) -> None:
    with ds_zero.Init(config_dict_or_path={**config, "zero_optimization": {"stage": 3}}):
        layer = nn.Linear(3, 3)
    assert layer.weight.dtype == layer.bias.dtype == dtype


def test_init_refuses_both_precision_switches_and_both_bf16_names() -> None:
    with pytest.raises(ValueError, match=r"bfloat16.enabled and fp16.enabled are both true"):
        ds_zero.Init(config_dict_or_path={"bfloat16": {"enabled": True}, "fp16": {"enabled": True}})
    with pytest.raises(ValueError, match=r"both 'bfloat16' \(the legacy name\) and 'bf16' are in the config"):
        ds_zero.Init(config_dict_or_path={"bf16": {"enabled": False}, "bfloat16": {"enabled": True}})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"remote_device": "nvme"}, "remote_device='nvme'.*needs zero_optimization.offload_param.nvme_path"),
        ({"remote_device": "disk"}, "remote_device='disk'"),
        ({"mpu": object()}, "model parallelism is not supported"),
        ({"config_dict_or_path": "/no/such/ds_config.json"}, "no such file"),
        (
            {"config_dict_or_path": {"zero_optimization": {"stage3_max_live_parameters": -1}}},
            "zero_optimization.stage3_max_live_parameters",
        ),
    ],
)
def test_init_rejects_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        ds_zero.Init(**kwargs)


def test_gathered_parameters_rejects_a_module_and_a_bad_modifier_rank() -> None:
    model = _mlp()
    ds_zero.partition_model(model)
    with pytest.raises(TypeError, match=r"module.parameters\(\)"):
        GatheredParameters(model)
    with pytest.raises(ValueError, match="modifier_rank=3"):
        GatheredParameters(model.parameters(), modifier_rank=3)


def test_forward_of_a_partitioned_but_unmanaged_model_is_refused() -> None:
    model = _mlp()
    ds_zero.partition_model(model)
    with pytest.raises(RuntimeError, match="nothing gathers it for this forward"):
        model(torch.randn(2, 6))
    with GatheredParameters(model.parameters()):
        assert model(torch.randn(2, 6)).shape == (2, 3)


@pytest.mark.parametrize("counted", [True, False], ids=["refcount", "no-refcount"])
def test_a_release_leaves_memory_another_tensor_holds_and_frees_the_rest(
    counted: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ds_zero._params import partitioned_param

    if not counted:  # a torch without the storage reference count: every release leaves the memory to refcount
        monkeypatch.setattr(partitioned_param, "_use_count", None)
    model = _mlp()
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    ds_zero.partition_model(model)
    w, b = model[0].weight, model[0].bias
    with GatheredParameters([w, b]):
        kept, row = w.data, w.data[1]
        before = state_of(w).full_flat.untyped_storage()._cdata
        used = b.float().sum().item()  # b is read, nothing kept
    assert torch.equal(kept, want["0.weight"]) and torch.equal(row, want["0.weight"][1])
    assert w.ds_status is b.ds_status is ZeroParamStatus.NOT_AVAILABLE and torch.isnan(w.sum())
    assert state_of(w).full_flat.untyped_storage()._cdata != before  # w got a new storage; `kept` has the old
    assert state_of(w).full_flat.untyped_storage().nbytes() == state_of(b).full_flat.untyped_storage().nbytes() == 0
    with GatheredParameters([w], modifier_rank=0):
        w.data.mul_(2.0)  # a later gather (and edit) never writes into what `kept` holds
    assert torch.equal(kept, want["0.weight"])
    with GatheredParameters([w, b]):
        assert torch.equal(w, 2.0 * want["0.weight"]) and b.float().sum().item() == used
