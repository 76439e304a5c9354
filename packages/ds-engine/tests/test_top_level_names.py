"""The top-level names of `deepspeed` 0.19.8 that scripts use, on ds_engine: OnDevice, get_accelerator, logger,
log_dist, DeepSpeedOptimizer, DeepSpeedDataLoader, TORCH_DISTRIBUTED_DEFAULT_PORT, the version triple,
git_hash/git_branch, `git_version_info`, `ops.__compatible_ops__`, `ops.op_builder`, `constants`."""

from __future__ import annotations

import inspect
import logging

import pytest
import torch
from ds_engine_testkit import base_config, make_engine, tiny_net

import ds_comm
import ds_engine
import ds_ops


def test_plain_aliases_are_the_implementing_objects() -> None:
    assert ds_engine.get_accelerator is ds_comm.get_accelerator
    assert ds_engine.logger is logging.getLogger("DeepSpeed") and ds_engine.log_dist is ds_comm.log_dist
    assert ds_engine.utils.OnDevice is ds_engine.OnDevice
    assert ds_engine.TORCH_DISTRIBUTED_DEFAULT_PORT == 29500 == ds_engine.constants.TORCH_DISTRIBUTED_DEFAULT_PORT
    assert inspect.signature(ds_engine.initialize).parameters["distributed_port"].default == 29500
    major, minor, patch = (int(p) for p in ds_engine.__version__.split("+")[0].split(".")[:3])
    assert (ds_engine.__version_major__, ds_engine.__version_minor__, ds_engine.__version_patch__) == (
        major,
        minor,
        patch,
    )
    assert ds_engine.git_hash == ds_engine.__git_hash__ == ds_engine.git_version_info.git_hash == "[none]"
    assert ds_engine.ops.op_builder.CPUAdamBuilder is ds_ops.CPUAdamBuilder


def test_dataloader_and_optimizer_classes_match_what_initialize_builds() -> None:
    data = torch.utils.data.TensorDataset(torch.randn(8, 8), torch.randn(8, 4))
    _, optimizer, loader, _ = ds_engine.initialize(
        model=tiny_net(0), config=base_config(bf16={"enabled": True}), training_data=data, dist_init_required=False
    )
    assert isinstance(loader, ds_engine.DeepSpeedDataLoader)
    assert isinstance(optimizer, ds_engine.DeepSpeedOptimizer)
    fp32 = make_engine(tiny_net(0), base_config())
    assert not isinstance(fp32.optimizer, ds_engine.DeepSpeedOptimizer)  # the bare torch optimizer, as DeepSpeed


def test_git_version_info_describes_this_install() -> None:
    info = ds_engine.git_version_info
    assert info.version == ds_engine.__version__ and info.git_branch == "[none]"
    assert set(info.installed_ops) == set(ds_ops.ALL_OPS)
    assert info.torch_info["version"] == ".".join(torch.__version__.split(".")[:2])
    assert info.accelerator_name == ds_comm.get_accelerator().name
    compatible = ds_engine.ops.__compatible_ops__
    assert compatible["deepspeed_not_implemented"] is False
    assert compatible["cpu_adam"] == bool(ds_ops.CPUAdamBuilder().is_compatible())
    assert set(compatible) == {*ds_ops.ALL_OPS, "deepspeed_not_implemented"}
    # fused_adam is answered for the accelerator's implementation: the CPU Adam kernel on a CPU host
    fused_adam = ds_engine.ops.op_builder.FusedAdamBuilder
    assert fused_adam.NAME == "fused_adam"
    if ds_comm.get_accelerator().device_name() == "cpu":
        assert fused_adam is ds_ops.op_builder.CPUFusedAdamBuilder
        assert compatible["fused_adam"] == bool(ds_ops.CPUAdamBuilder().is_compatible())
    else:
        assert fused_adam is ds_ops.FusedAdamBuilder
    # an op ds does not implement resolves as on DeepSpeed's CPU accelerator: listed, never compatible
    from ds_engine.ops.op_builder import InferenceBuilder

    assert InferenceBuilder.NAME == "deepspeed_not_implemented" and not compatible[InferenceBuilder.NAME]
    assert not InferenceBuilder().is_compatible()
    with pytest.raises(ds_ops.OpNotCompatibleError, match="not implemented in ds"):
        InferenceBuilder().load()
    with pytest.raises(AttributeError, match="NoSuchBuilder"):
        ds_engine.ops.op_builder.NoSuchBuilder  # noqa: B018


def test_on_device_builds_on_meta_in_the_dtype_and_restores() -> None:
    with ds_engine.OnDevice(dtype=torch.bfloat16, device="meta"):
        model = torch.nn.Linear(3, 4)
        ints = torch.arange(3)
    assert model.weight.device.type == "meta" and model.weight.dtype == torch.bfloat16
    assert ints.dtype == torch.int64  # only floating-point tensors take the dtype
    assert torch.get_default_dtype() == torch.float32 and torch.empty(1).device.type == "cpu"
    with pytest.raises(RuntimeError, match="boom"), ds_engine.OnDevice(dtype=torch.float16):
        raise RuntimeError("boom")
    assert torch.get_default_dtype() == torch.float32 and torch.empty(1).device.type == "cpu"
    with ds_engine.OnDevice(dtype=torch.float16, enabled=False):
        assert torch.empty(1).dtype == torch.float32
    with pytest.raises(TypeError, match="floating-point dtype"):
        ds_engine.OnDevice(dtype=torch.int8)
