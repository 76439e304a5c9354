"""DeepSpeed's module paths of the ZeRO user API resolve to ds's objects: accessors, leaf modules, ZeRO-3 tools.

`deepspeed.utils.safe_get_full_fp32_param` and the 12 other accessors (and `deepspeed.utils.tensor_fragment`),
the leaf-module functions (and `deepspeed.utils.z3_leaf_module`, callable as DeepSpeed's function of that
name), `deepspeed.runtime.zero.partition_parameters.ZeroParamType`, `deepspeed.runtime.zero.
unwrap_model_for_generation`, `deepspeed.runtime.zero.tiling.TiledLinear` and `deepspeed.runtime.utils`.
"""

from __future__ import annotations

import importlib

import pytest
import torch

ds_zero = pytest.importorskip("ds_zero", reason="the ZeRO user API needs ds-zero: pip install 'ds-engine[zero]'")

ACCESSORS = [
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_optimizer_state",
    "safe_set_full_grad",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "safe_update_full_grad_vectorized",
]
LEAF = [
    "set_z3_leaf_modules",
    "unset_z3_leaf_modules",
    "get_z3_leaf_modules",
    "z3_leaf_parameter",
    "set_z3_leaf_module",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
]


@pytest.mark.parametrize("name", ACCESSORS)
def test_accessors_on_utils_and_tensor_fragment(name: str) -> None:
    utils = importlib.import_module("ds_engine.utils")
    fragment = importlib.import_module("ds_engine.utils.tensor_fragment")
    assert getattr(utils, name) is getattr(fragment, name)
    assert name in utils.__all__ and name in fragment.__all__


@pytest.mark.parametrize("name", LEAF)
def test_leaf_functions_are_ds_zeros(name: str) -> None:
    from ds_engine import utils
    from ds_engine.utils import z3_leaf_module

    assert getattr(utils, name) is getattr(z3_leaf_module, name) is getattr(ds_zero, name)


def test_z3_leaf_module_is_the_module_and_callable_as_the_function() -> None:
    from ds_engine.utils import z3_leaf_module

    module = torch.nn.Linear(1, 1)
    assert z3_leaf_module(module) is False
    ds_zero.set_z3_leaf_module(module, True)
    assert z3_leaf_module(module) is True and z3_leaf_module.z3_leaf_module(module) is True


def test_zero3_paths() -> None:
    pp = importlib.import_module("ds_engine.runtime.zero.partition_parameters")
    zero = importlib.import_module("ds_engine.runtime.zero")
    assert pp.ZeroParamType is ds_zero.ZeroParamType and pp.ZeroParamStatus is ds_zero.ZeroParamStatus
    assert pp.register_external_parameter is ds_zero.register_external_parameter
    assert pp.unregister_external_parameter is ds_zero.unregister_external_parameter
    assert zero.GatheredParameters is ds_zero.GatheredParameters
    assert zero.unwrap_model_for_generation is ds_zero.unwrap_model_for_generation
    stage3 = importlib.import_module("ds_engine.runtime.zero.stage3")
    assert stage3.unwrap_model_for_generation is ds_zero.unwrap_model_for_generation
    assert stage3.DeepSpeedZeroOptimizer_Stage3 is ds_zero.DeepSpeedZeroOptimizer_Stage3
    tiling = importlib.import_module("ds_engine.runtime.zero.tiling")
    assert tiling.TiledLinear is ds_zero.TiledLinear and tiling.TiledLinearReturnBias is ds_zero.TiledLinearReturnBias
    with pytest.raises(AttributeError, match="has no attribute 'Init'"):
        tiling.Init  # noqa: B018 - only the module's own names


def test_zeropp_names_in_partition_parameters(capsys: pytest.CaptureFixture[str]) -> None:
    pp = importlib.import_module("ds_engine.runtime.zero.partition_parameters")
    assert pp.CUDAQuantizer is ds_zero.CUDAQuantizer and pp.Init is ds_zero.Init
    assert callable(pp.Init._partition_param_sec)
    pp.print_rank_0("quiet")
    pp.print_rank_0("loud", force=True)
    pp.print_rank_0("debug", debug=True)
    assert capsys.readouterr().out == "loud\ndebug\n"  # rank 0 of a single process


def test_runtime_utils_is_a_lazy_runtime_attribute() -> None:
    runtime = importlib.import_module("ds_engine.runtime")
    assert runtime.utils.move_to_device is importlib.import_module("ds_engine.runtime.utils").move_to_device


def test_local_accessors_refuse_unpartitioned_parameters() -> None:
    from ds_engine.utils import safe_get_full_fp32_param, safe_get_full_grad, safe_get_local_grad

    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.full((2,), 3.0)
    assert safe_get_full_fp32_param(p) is None and safe_get_full_grad(p) is p.grad  # no ZeRO: DeepSpeed's answers
    with pytest.raises(ValueError, match="ZeRO-3 partitioned parameters only"):
        safe_get_local_grad(p)


def test_zero12_path_names_the_engines_optimizer_class() -> None:
    from ds_engine_testkit import base_config, make_engine, tiny_net

    stage12 = importlib.import_module("ds_engine.runtime.zero.stage_1_and_2")
    assert stage12.DeepSpeedZeroOptimizer is ds_zero.DeepSpeedZeroOptimizer
    assert (
        stage12.estimate_zero2_model_states_mem_needs_all_live is ds_zero.estimate_zero2_model_states_mem_needs_all_live
    )
    engine = make_engine(tiny_net(0), base_config(zero_optimization={"stage": 2}))
    assert isinstance(engine.optimizer, stage12.DeepSpeedZeroOptimizer)
    with pytest.raises(AttributeError, match="has no attribute 'Init'"):
        stage12.Init  # noqa: B018 - only the module's own names


def test_partition_parameters_has_the_single_rank_group_check() -> None:
    pp = importlib.import_module("ds_engine.runtime.zero.partition_parameters")
    check = pp._contradicting_single_rank_pg_error
    message = check(dp_world_size=1, explicit_process_group=None, env={"WORLD_SIZE": "2"})
    assert message == ds_zero.single_rank_group_error(1, None, env={"WORLD_SIZE": "2"})
    assert message is not None and "WORLD_SIZE=2" in message
    assert check(1, None, env={"WORLD_SIZE": "1"}) is None
    assert "_contradicting_single_rank_pg_error" in dir(pp)
