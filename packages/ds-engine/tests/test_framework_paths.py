"""DeepSpeed paths and values the framework integrations (HF Trainer, Accelerate, Lightning) use.

`steps_per_print: inf` (Accelerate), `deepspeed.checkpoint.utils.clone_tensors_for_torch_save`
(Accelerate's get_state_dict), `deepspeed.utils.logging.logger` (Lightning),
`deepspeed.runtime.zero.partition_parameters` (transformers' from_pretrained under zero.Init).
Tests whose name says "zero" need ds-zero and run in the ds-engine[all] session.
"""

from __future__ import annotations

import importlib
import logging
from collections import OrderedDict

import pytest
import torch

from ds_engine import DeepSpeedConfig, DeepSpeedConfigError
from ds_engine.checkpoint.utils import clone_tensors_for_torch_save


@pytest.mark.parametrize(("value", "expected"), [(float("inf"), None), (None, None), (5, 5), (5.0, 5)])
def test_steps_per_print_inf_means_never(value: float | None, expected: int | None) -> None:
    config = DeepSpeedConfig({"train_batch_size": 2, "steps_per_print": value}, world_size=1)
    assert config.parsed.steps_per_print == expected


@pytest.mark.parametrize("value", [float("-inf"), float("nan"), 0, -3, True])
def test_steps_per_print_rejects_other_non_intervals(value: float) -> None:
    with pytest.raises(DeepSpeedConfigError, match="steps_per_print"):
        DeepSpeedConfig({"train_batch_size": 2, "steps_per_print": value}, world_size=1)


def test_clone_tensors_for_torch_save_gives_each_view_its_own_storage() -> None:
    flat = torch.arange(12, dtype=torch.float32, requires_grad=True)
    state = OrderedDict(a=flat[:4].view(2, 2), b=flat[4:])
    nested = {"state": state, "pair": (flat[:1], 3), "list": [flat[2:3], "x"], "step": 7}
    cloned = clone_tensors_for_torch_save(nested)
    assert type(cloned["state"]) is OrderedDict and list(cloned["state"]) == ["a", "b"]
    assert isinstance(cloned["pair"], tuple) and cloned["pair"][1] == 3
    assert cloned["list"][1] == "x" and cloned["step"] == 7
    for got, src in (
        (cloned["state"]["a"], state["a"]),
        (cloned["state"]["b"], state["b"]),
        (cloned["pair"][0], flat[:1]),
        (cloned["list"][0], flat[2:3]),
    ):
        assert torch.equal(got, src.detach())
        assert not got.requires_grad and got.device.type == "cpu"
        # its own storage of its own size: torch.save writes only this tensor, not the flat buffer
        assert got.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
        assert got.untyped_storage().nbytes() == got.numel() * got.element_size()
    with torch.no_grad():
        flat.zero_()
    assert cloned["state"]["b"][0].item() == 4.0  # a copy, not an alias


def test_clone_tensors_for_torch_save_to_a_device() -> None:
    out = clone_tensors_for_torch_save({"w": torch.ones(2)}, device="meta")
    assert out["w"].device.type == "meta"


def test_utils_logging_is_the_submodule_with_deepspeeds_logger() -> None:
    module = importlib.import_module("ds_engine.utils.logging")
    utils = importlib.import_module("ds_engine.utils")
    assert utils.logging is module  # not the standard library's logging
    assert module.logger is utils.logger is logging.getLogger("DeepSpeed")
    assert callable(module.log_dist)


def test_checkpoint_is_a_top_level_submodule() -> None:
    import ds_engine

    assert ds_engine.checkpoint.utils.clone_tensors_for_torch_save is clone_tensors_for_torch_save


def test_runtime_zero_partition_parameters_reexports_ds_zero() -> None:
    ds_zero = pytest.importorskip("ds_zero")
    import ds_engine

    pp = importlib.import_module("ds_engine.runtime.zero.partition_parameters")
    for name in ("Init", "GatheredParameters", "register_external_parameter", "ZeroParamStatus", "is_zero_param"):
        assert getattr(pp, name) is getattr(ds_zero, name), name
    assert ds_engine.runtime.zero.Init is ds_zero.Init is ds_engine.zero.Init
    assert pp._orig_torch_arange is torch.arange and pp._orig_torch_empty is torch.empty
    assert {"Init", "zero_wrapper_for_fp_tensor_constructor", "get_accelerator"} <= set(dir(pp))
    with pytest.raises(AttributeError, match="no_such_name"):
        pp.no_such_name  # noqa: B018


def test_runtime_zero_tensor_constructor_hook_casts_floats_and_places_them() -> None:
    pytest.importorskip("ds_zero")
    pp = importlib.import_module("ds_engine.runtime.zero.partition_parameters")

    empty = pp.zero_wrapper_for_fp_tensor_constructor(torch.empty, torch.float16, target_device="cpu")
    assert empty(2, 3).dtype == torch.float16 and empty(2, 3).device.type == "cpu"
    assert empty(2, device="meta").device.type == "meta"  # the caller's device wins
    arange = pp.zero_wrapper_for_fp_tensor_constructor(pp._orig_torch_arange, torch.bfloat16, target_device="cpu")
    assert arange(4).dtype == torch.int64  # integer results keep their dtype
    assert arange(0.0, 1.0, 0.5).dtype == torch.bfloat16
    assert empty.__name__ == torch.empty.__name__


def test_runtime_engine_is_the_engine_module_path() -> None:
    import ds_engine
    from ds_engine.runtime.engine import DeepSpeedEngine

    assert DeepSpeedEngine is ds_engine.DeepSpeedEngine


def test_base_optimizer_recognises_the_precision_wrapper_only() -> None:
    from ds_engine import MixedPrecisionOptimizer
    from ds_engine.runtime.base_optimizer import DeepSpeedOptimizer, ZeROOptimizer

    assert issubclass(MixedPrecisionOptimizer, DeepSpeedOptimizer)
    assert not issubclass(MixedPrecisionOptimizer, ZeROOptimizer)
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    assert not isinstance(sgd, DeepSpeedOptimizer) and not isinstance(sgd, ZeROOptimizer)


def test_base_optimizer_recognises_the_zero_optimizers() -> None:
    ds_zero = pytest.importorskip("ds_zero")
    from ds_engine.runtime.base_optimizer import DeepSpeedOptimizer, ZeROOptimizer

    for cls in (ds_zero.DeepSpeedZeroOptimizer, ds_zero.DeepSpeedZeroOptimizer_Stage3):
        assert issubclass(cls, DeepSpeedOptimizer) and issubclass(cls, ZeROOptimizer), cls
