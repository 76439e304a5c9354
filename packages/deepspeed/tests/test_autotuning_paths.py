"""`deepspeed.autotuning.*` are ds-launcher's autotuner modules, and the two readers of the `autotuning` section
(ds-engine's, in every experiment, and ds-launcher's, in the autotuner) agree on its keys and defaults."""

from __future__ import annotations

import importlib

import pytest

from ds_engine.config._autotuning import AutotuningConfig, AutotuningModelInfo
from ds_launcher.autotuning.config import AutotuningModelInfo as LauncherModelInfo
from ds_launcher.autotuning.config import AutotuningSettings

PATHS = [
    "",
    ".autotuner",
    ".config",
    ".constants",
    ".scheduler",
    ".utils",
    ".tuner",
    ".tuner.base_tuner",
    ".tuner.cost_model",
    ".tuner.index_based_tuner",
    ".tuner.model_based_tuner",
]


@pytest.mark.parametrize("suffix", PATHS)
def test_deepspeed_autotuning_paths_are_the_launchers_modules(suffix: str) -> None:
    module = importlib.import_module("deepspeed.autotuning" + suffix)
    assert module is importlib.import_module("ds_launcher.autotuning" + suffix)


def test_deepspeed_names() -> None:
    from deepspeed.autotuning import Autotuner
    from deepspeed.autotuning.scheduler import ResourceManager
    from deepspeed.autotuning.tuner import GridSearchTuner, ModelBasedTuner, RandomTuner
    from deepspeed.autotuning.utils import get_val_by_key, set_val_by_key

    assert Autotuner.__module__ == "ds_launcher._autotuning.autotuner"
    assert ResourceManager.__name__ == "ExperimentScheduler"
    assert {GridSearchTuner.__name__, RandomTuner.__name__, ModelBasedTuner.__name__} == {
        "GridSearchTuner",
        "RandomTuner",
        "ModelBasedTuner",
    }
    d = {"a": {"b": 1}, "c": {"d": {"e": 2}}}
    set_val_by_key(d, "e", 3)
    assert get_val_by_key(d, "e") == 3 and get_val_by_key(d, "x") is None


@pytest.mark.parametrize(
    ("engine_model", "launcher_model"),
    [(AutotuningConfig, AutotuningSettings), (AutotuningModelInfo, LauncherModelInfo)],
)
def test_engine_and_launcher_read_the_same_section(engine_model, launcher_model) -> None:
    engine = {name: field.default for name, field in engine_model.model_fields.items()}
    launcher = {name: field.default for name, field in launcher_model.model_fields.items()}
    assert engine == launcher
