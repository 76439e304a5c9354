"""DeepSpeed's data efficiency paths (`runtime.data_pipeline...`, `ops.random_ltd...`) re-export `_data_efficiency`.

Scripts written for DeepSpeed import these modules by name (DeepSpeedExamples' random-LTD finetuning
imports `data_routing.helper`); each must give the ds object itself, reachable as an attribute too.
"""

from __future__ import annotations

import importlib

import pytest

import ds_engine
from ds_engine._data import (
    curriculum,
    keys,
    ltd_helpers,
    ltd_loops,
    ltd_scheduler,
    section,
    token_drop,
    token_ops,
)

PATHS = {
    "runtime.data_pipeline.curriculum_scheduler": {"CurriculumScheduler": curriculum.CurriculumScheduler},
    "runtime.data_pipeline.data_routing.scheduler": {
        "RandomLTDScheduler": ltd_scheduler.RandomLTDScheduler,
        "BaseScheduler": ltd_scheduler.BaseScheduler,
    },
    "runtime.data_pipeline.data_routing.basic_layer": {"RandomLayerTokenDrop": token_drop.RandomLayerTokenDrop},
    "runtime.data_pipeline.data_routing.helper": {
        "convert_to_random_ltd": ltd_helpers.convert_to_random_ltd,
        "save_without_random_ltd": ltd_helpers.save_without_random_ltd,
        "remove_random_ltd_state_dict": ltd_helpers.remove_random_ltd_state_dict,
    },
    "runtime.data_pipeline.data_routing.utils": {
        "bsh_decoder_gather": ltd_loops.bsh_decoder_gather,
        "bsh_decoder_scatter": ltd_loops.bsh_decoder_scatter,
    },
    "runtime.data_pipeline.config": {"get_data_efficiency_config": section.get_data_efficiency_config},
    "runtime.data_pipeline.constants": {
        "RANDOM_LTD": "random_ltd",
        "CURRICULUM_LEARNING_MAX_DIFFICULTY": "max_difficulty",
    },
    "ops.random_ltd.dropping_utils": {
        "GatherTokens": token_ops.GatherTokens,
        "ScatterTokens": token_ops.ScatterTokens,
        "gpt_sample_tokens": token_ops.gpt_sample_tokens,
        "bert_sample_tokens": token_ops.bert_sample_tokens,
    },
    "ops.random_ltd": {"GatherTokens": token_ops.GatherTokens},
}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_path_reexports_the_ds_object(path: str) -> None:
    module = importlib.import_module(f"ds_engine.{path}")
    for name, expected in PATHS[path].items():
        assert getattr(module, name) is expected or getattr(module, name) == expected
        assert name in module.__all__


def test_constants_star_import_gives_every_key() -> None:
    namespace: dict[str, object] = {}
    exec("from ds_engine.runtime.data_pipeline.constants import *", namespace)  # noqa: S102
    assert {name for name in namespace if name.isupper()} == set(keys.__all__)


def test_modules_are_attributes_of_their_parents() -> None:
    assert (
        ds_engine.runtime.data_pipeline.data_routing.helper.convert_to_random_ltd is ltd_helpers.convert_to_random_ltd
    )
    assert ds_engine.ops.random_ltd.dropping_utils.GatherTokens is token_ops.GatherTokens
