"""`import deepspeed` is ds-engine's API; DeepSpeed's module paths are the ds modules themselves."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import subprocess
import sys

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

import deepspeed
import ds_engine
import ds_launcher
from deepspeed import _aliases

# DeepSpeed paths the frameworks import (transformers, accelerate, lightning), and what implements them.
FRAMEWORK_PATHS = {
    "deepspeed.comm": "ds_engine._comm",
    "deepspeed.accelerator": "ds_comm.accelerator",
    "deepspeed.accelerator.cpu_accelerator": "ds_comm.accelerator.cpu_accelerator",
    "deepspeed.accelerator.real_accelerator": "ds_comm.accelerator.real_accelerator",
    "deepspeed.utils.pin_memory": "ds_comm.native_pinned_memory",
    "deepspeed.ops": "ds_engine.ops",
    "deepspeed.ops.adam": "ds_engine.ops.adam",
    "deepspeed.ops.adagrad": "ds_engine.ops.adagrad",
    "deepspeed.ops.lion": "ds_engine.ops.lion",
    "deepspeed.utils": "ds_engine.utils",
    "deepspeed.utils.zero_to_fp32": "ds_engine.utils.zero_to_fp32",
    "deepspeed.runtime": "ds_engine.runtime",
    "deepspeed.runtime.lr_schedules": "ds_engine.runtime.lr_schedules",
    "deepspeed.runtime.engine": "ds_engine.runtime.engine",
    "deepspeed.runtime.base_optimizer": "ds_engine.runtime.base_optimizer",
    "deepspeed.runtime.zero": "ds_engine.runtime.zero",
    "deepspeed.runtime.zero.partition_parameters": "ds_engine.runtime.zero.partition_parameters",
    "deepspeed.runtime.comm.coalesced_collectives": "ds_engine.runtime.comm.coalesced_collectives",
    "deepspeed.runtime.swap_tensor": "ds_engine.runtime.swap_tensor",
    "deepspeed.runtime.utils": "ds_engine.runtime.utils",
    "deepspeed.checkpoint": "ds_engine.checkpoint",
    "deepspeed.checkpoint.utils": "ds_engine.checkpoint.utils",
    "deepspeed.checkpoint.ds_to_universal": "ds_engine.checkpoint.ds_to_universal",
    "deepspeed.utils.logging": "ds_engine._report.logging",
    "deepspeed.launcher": "ds_launcher",
    "deepspeed.launcher.runner": "ds_launcher.runner",
}


def test_distribution_metadata_is_found_under_deepspeed() -> None:
    meta = importlib.metadata.metadata("deepspeed")
    assert meta["Name"] == "deepspeed"
    assert importlib.metadata.version("deepspeed") == deepspeed.__version__


def test_version_is_deepspeed_api_level_and_ds_engine_keeps_its_own() -> None:
    version = Version(deepspeed.__version__)
    assert version.public == "0.19.8"
    assert version.local is not None and version.local.startswith("ds")
    assert ds_engine.__version__ != deepspeed.__version__
    assert deepspeed.version == deepspeed.__version__
    assert (deepspeed.__version_major__, deepspeed.__version_minor__, deepspeed.__version_patch__) == (0, 19, 8)


@pytest.mark.parametrize("spec", [">=0.9.3", ">=0.16.4", "==0.19.8", "<0.20", ">=0.14.0,<1"])
def test_version_satisfies_framework_requirements(spec: str) -> None:
    assert SpecifierSet(spec).contains(Version(deepspeed.__version__))


def test_top_level_names_are_ds_engine_objects() -> None:
    for name in ds_engine.__all__:
        if name in ("__version__", "version"):
            continue
        assert getattr(deepspeed, name) is getattr(ds_engine, name), name
    assert deepspeed.zero is importlib.import_module("ds_engine.zero")
    assert deepspeed.DeepSpeedConfig is ds_engine.DeepSpeedConfig


def test_unknown_top_level_name_raises_attribute_error_naming_deepspeed() -> None:
    with pytest.raises(AttributeError, match="module 'deepspeed' has no attribute 'no_such_thing'"):
        deepspeed.no_such_thing  # noqa: B018


@pytest.mark.parametrize(("path", "target"), sorted(FRAMEWORK_PATHS.items()))
def test_module_path_is_the_ds_module_itself(path: str, target: str) -> None:
    module = importlib.import_module(path)
    assert module is importlib.import_module(target)
    assert sys.modules[path] is module
    # The module stays ds's own: its name and spec are not rewritten by the alias.
    assert module.__name__ == target
    assert module.__spec__ is not None and module.__spec__.name == target


@pytest.mark.parametrize(
    "path",
    [
        "deepspeed.runtime.tensor_parallel",
        "deepspeed.runtime.tensor_parallel.config",
        "deepspeed.runtime.tensor_parallel.tp_manager",
        "deepspeed.module_inject.auto_tp",
    ],
)
def test_autotp_training_paths_are_ds_engine_modules(path: str) -> None:
    pytest.importorskip("ds_parallel")
    target = "ds_engine" + path.removeprefix("deepspeed")
    assert importlib.import_module(path) is importlib.import_module(target)


def test_deepspeed_chat_names_resolve() -> None:
    # Every DeepSpeed name DeepSpeed-Chat (DeepSpeedExamples/applications/DeepSpeed-Chat) imports.
    import warnings

    import ds_comm
    import ds_ops
    import ds_zero
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.utils.module_utils import recursive_getattr, recursive_setattr

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated path, as in DeepSpeed 0.19.8
        from deepspeed.compression.helper import recursive_getattr as old_getattr
        from deepspeed.compression.helper import recursive_setattr as old_setattr

    assert (old_getattr, old_setattr) == (recursive_getattr, recursive_setattr)
    assert deepspeed.utils.recursive_getattr is recursive_getattr
    assert importlib.import_module("deepspeed.compression.helper") is importlib.import_module(
        "ds_engine.compression.helper"
    )
    assert get_accelerator is deepspeed.get_accelerator is ds_comm.get_accelerator
    assert (DeepSpeedCPUAdam, FusedAdam) == (ds_ops.DeepSpeedCPUAdam, ds_ops.FusedAdam)
    assert ZeroParamStatus is ds_zero.ZeroParamStatus
    assert deepspeed.zero.GatheredParameters is ds_zero.GatheredParameters
    assert deepspeed.comm.get_rank is ds_comm.get_rank
    for name in ("initialize", "init_distributed", "add_config_arguments"):
        assert callable(getattr(deepspeed, name))


def test_from_import_through_alias() -> None:
    import ds_ops
    from deepspeed.launcher.runner import main
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES, WarmupDecayLR

    assert DeepSpeedCPUAdam is ds_ops.DeepSpeedCPUAdam
    assert main is ds_launcher.runner.main
    assert "WarmupDecayLR" in VALID_LR_SCHEDULES
    assert WarmupDecayLR is ds_engine.lr_schedules.WarmupDecayLR


def test_framework_names_resolve() -> None:
    import ds_zero
    from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
    from deepspeed.launcher.runner import DEEPSPEED_ENVIRONMENT_NAME
    from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.utils import CheckOverflow, get_weight_norm
    from deepspeed.runtime.zero import partition_parameters as pp
    from deepspeed.utils import logger

    assert DeepSpeedEngine is deepspeed.DeepSpeedEngine
    assert CheckOverflow.__module__ == get_weight_norm.__module__ == "ds_engine._step.overflow_check"
    assert pp.Init is deepspeed.zero.Init is ds_zero.Init
    assert callable(pp.zero_wrapper_for_fp_tensor_constructor) and callable(clone_tensors_for_torch_save)
    assert issubclass(ds_zero.DeepSpeedZeroOptimizer, DeepSpeedOptimizer)
    assert DEEPSPEED_ENVIRONMENT_NAME == ".deepspeed_env"
    assert deepspeed.utils.logging.logger is logger  # Lightning sets the level through this path
    assert logger is logging.getLogger("DeepSpeed") and logging.getLogger("ds_zero").parent is logger


def test_transformers_style_patch_of_the_constructor_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    # transformers' prevent_arange_dtype_change: save, replace, restore through the DeepSpeed path.
    from deepspeed.runtime.zero import partition_parameters as pp

    original = pp.zero_wrapper_for_fp_tensor_constructor
    monkeypatch.setattr(pp, "zero_wrapper_for_fp_tensor_constructor", lambda fn, *a, **k: fn)
    assert (
        importlib.import_module("ds_engine.runtime.zero.partition_parameters").zero_wrapper_for_fp_tensor_constructor
        is not original
    )
    monkeypatch.undo()
    assert pp.zero_wrapper_for_fp_tensor_constructor is original


def test_monkeypatch_through_alias_reaches_ds_module(monkeypatch: pytest.MonkeyPatch) -> None:
    alias = importlib.import_module("deepspeed.runtime.lr_schedules")
    sentinel = ["Patched"]
    monkeypatch.setattr(alias, "VALID_LR_SCHEDULES", sentinel)
    assert importlib.import_module("ds_engine.runtime.lr_schedules").VALID_LR_SCHEDULES is sentinel


def test_unknown_path_is_module_not_found() -> None:
    assert importlib.util.find_spec("deepspeed.no_such_module") is None
    with pytest.raises(ModuleNotFoundError, match="deepspeed.no_such_module"):
        importlib.import_module("deepspeed.no_such_module")
    with pytest.raises(ModuleNotFoundError, match="deepspeed.runtime.no_such_module"):
        importlib.import_module("deepspeed.runtime.no_such_module")


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("deepspeed", None),
        ("deepspeedx", None),
        ("ds_engine.zero", None),
        ("deepspeed.zero", "ds_engine.zero"),
        ("deepspeed.runtime.zero.partition_parameters", "ds_engine.runtime.zero.partition_parameters"),
        ("deepspeed.launcher", "ds_launcher"),
        ("deepspeed.launcher.launch", "ds_launcher.launch"),
        ("deepspeed.launchers", "ds_engine.launchers"),
    ],
)
def test_resolve(name: str, expected: str | None) -> None:
    assert _aliases.resolve(name) == expected


def test_finder_is_installed_once() -> None:
    _aliases.install()
    assert sum(isinstance(f, _aliases.AliasFinder) for f in sys.meta_path) == 1


def test_no_console_script_of_its_own() -> None:
    # ds-launcher owns the `deepspeed` command; two distributions writing it would clobber each other.
    scripts = [ep for ep in importlib.metadata.distribution("deepspeed").entry_points if ep.group == "console_scripts"]
    assert scripts == []


def test_python_dash_m_runs_the_aliased_module() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "deepspeed.launcher.runner", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "--num_gpus" in out.stdout


# A DeepSpeed 0.19.8 module of CUDA-only kernels, which ds does not implement.
MISSING_DEEPSPEED_PATH = "deepspeed.inference.v2.kernels.ragged_ops"


def test_a_deepspeed_path_ds_lacks_fails_naming_it_and_the_compatibility_page() -> None:
    with pytest.raises(ModuleNotFoundError) as info:
        importlib.import_module(MISSING_DEEPSPEED_PATH)
    # The import system imports the parents first; the first one ds lacks is the one named.
    assert info.value.name is not None and MISSING_DEEPSPEED_PATH.startswith(info.value.name)
    assert f"{info.value.name} is a DeepSpeed 0.19.8 module that ds does not implement" in str(info.value)
    assert _aliases.COMPATIBILITY_PAGE in str(info.value)
    assert info.value.name not in sys.modules


def test_a_path_deepspeed_never_had_stays_a_plain_module_not_found() -> None:
    with pytest.raises(ModuleNotFoundError, match=r"No module named 'deepspeed\.no_such_module'"):
        importlib.import_module("deepspeed.no_such_module")


def test_the_module_list_is_deepspeeds_and_every_framework_path_is_in_it() -> None:
    paths = _aliases.deepspeed_module_paths()
    assert len(paths) == 751
    assert "deepspeed" in paths and MISSING_DEEPSPEED_PATH in paths
    assert set(FRAMEWORK_PATHS) <= paths


def test_importing_deepspeed_makes_deepspeeds_checkpoint_layout_the_default() -> None:
    """ds-engine alone saves in ds's layout; once `deepspeed` is imported, an unset `checkpoint.layout` means
    DeepSpeed's (a fresh interpreter: this one imported deepspeed above)."""
    code = (
        "import ds_engine.config as c\n"
        "before = c.default_checkpoint_layout()\n"
        "import deepspeed\n"
        "print(before, c.default_checkpoint_layout())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == ["ds", "deepspeed"]
    assert deepspeed.initialize is ds_engine.initialize  # still ds-engine's own function
