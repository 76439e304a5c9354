"""The autotuner's inputs: the `autotuning` section (keys, defaults, bad values), finding the ds_config among
the script's arguments, and the search space built from them (stages, micro-batch sizes, accumulation, names)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds_comm import ConfigError
from ds_launcher._autotuning.settings import AutotuningSettings, find_user_config, read_settings
from ds_launcher._autotuning.space import (
    build_experiments,
    candidate_micro_batches,
    candidate_stages,
    instantiation_bytes,
    memory_bound,
)

#: DeepSpeed 0.19.8's keys and defaults (deepspeed/autotuning/constants.py).
DEEPSPEED_DEFAULTS = {
    "enabled": False,
    "fast": True,
    "results_dir": "autotuning_results",
    "exps_dir": "autotuning_exps",
    "overwrite": True,
    "start_profile_step": 3,
    "end_profile_step": 5,
    "metric": "throughput",
    "metric_path": None,
    "tuner_type": "gridsearch",
    "tuner_early_stopping": 5,
    "tuner_num_trials": 50,
    "arg_mappings": None,
    "model_info": None,
    "model_info_path": None,
    "mp_size": 1,
    "max_train_batch_size": None,
    "min_train_batch_size": 1,
    "max_train_micro_batch_size_per_gpu": 1024,
    "min_train_micro_batch_size_per_gpu": 1,
    "num_tuning_micro_batch_sizes": 3,
}


def test_defaults_are_deepspeeds() -> None:
    assert read_settings({}).model_dump() == DEEPSPEED_DEFAULTS
    assert read_settings({"autotuning": {"enabled": True}}).enabled


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"tuner_type": "bayes"}, r"autotuning.tuner_type: Input should be 'gridsearch', 'random' or 'model_based'"),
        ({"metric": "speed"}, r"autotuning.metric: Input should be 'throughput', 'latency' or 'flops'"),
        ({"tuner_num_trials": 0}, r"autotuning.tuner_num_trials: Input should be greater than 0"),
        ({"results_dir": ""}, r"autotuning.results_dir: String should have at least 1 character"),
        ({"start_profile_step": 5, "end_profile_step": 4}, r"autotuning: .*end_profile_step=4 is before"),
        ({"tuner_typ": "random"}, r"autotuning.tuner_typ: unknown key .*did you mean 'tuner_type'"),
        ({"model_info": {"num_param": 3}}, r"autotuning.model_info.num_param: unknown key"),
    ],
)
def test_bad_values_name_the_key(section: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        read_settings({"autotuning": section})


def test_find_user_config_in_the_script_arguments(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2}))
    for args, index in (
        (["--x", "1", "--deepspeed_config", str(path)], 3),
        ([f"--deepspeed_config={path}"], 0),
        (["--deepspeed", str(path)], 1),
    ):
        user = find_user_config(args)
        assert user.config == {"train_micro_batch_size_per_gpu": 2} and user.arg_index == index
        replaced = user.args_with(args, "/new.json")
        assert replaced[index] in ("/new.json", "--deepspeed_config=/new.json")
    with pytest.raises(ValueError, match="--autotuning needs the training script's ds_config"):
        find_user_config(["--steps", "3"])
    with pytest.raises(ValueError, match="no such file"):
        find_user_config(["--deepspeed_config", str(tmp_path / "missing.json")])
    path.write_text('{"a": 1, "a": 2}')
    with pytest.raises(ConfigError, match="a: the key appears twice"):
        find_user_config(["--deepspeed_config", str(path)])


def test_stages() -> None:
    assert candidate_stages({}) == [0]
    assert candidate_stages({"zero_optimization": {"stage": 2}}) == [2]
    assert candidate_stages({"zero_optimization": {"stage": [3, 1]}}) == [1, 3]
    assert candidate_stages({"zero_optimization": {"stage": "all"}}) == [0, 1, 2, 3]
    with pytest.raises(ConfigError, match=r"zero_optimization.stage: \[1, 4\]"):
        candidate_stages({"zero_optimization": {"stage": [1, 4]}})


def test_micro_batch_ladder_and_its_bounds() -> None:
    s = AutotuningSettings()
    assert candidate_micro_batches({"train_micro_batch_size_per_gpu": [4, 1, 4]}, s, num_ranks=2) == [1, 4]
    assert candidate_micro_batches({"train_micro_batch_size_per_gpu": 8}, s, num_ranks=2) == [8, 16, 32]
    assert candidate_micro_batches({}, s, num_ranks=2) == [1, 2, 4]
    assert candidate_micro_batches({}, s, num_ranks=2, bound=3) == [1, 2]
    capped = AutotuningSettings(max_train_batch_size=16, num_tuning_micro_batch_sizes=10)
    assert candidate_micro_batches({}, capped, num_ranks=2) == [1, 2, 4, 8]
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu"):
        candidate_micro_batches({"train_micro_batch_size_per_gpu": [0, 2]}, s, num_ranks=2)


def test_memory_bound_follows_the_model_states_per_stage() -> None:
    info = {"num_params": 1000, "activation_mem_per_gpu": 100}
    # fp32 Adam: 4 + 4 + 8 bytes per parameter at stage 0; stage 3 splits all of it over 4 ranks
    assert instantiation_bytes(1000, 0, num_ranks=4, half=False) == 16000
    assert instantiation_bytes(1000, 3, num_ranks=4, half=False) == 4000
    assert memory_bound(info, 0, memory_per_rank=20000, num_ranks=4, half=False, mp_size=1) == 40
    assert memory_bound(info, 3, memory_per_rank=20000, num_ranks=4, half=False, mp_size=1) == 160
    assert memory_bound(None, 0, memory_per_rank=1, num_ranks=1, half=False, mp_size=1) is None


def test_experiments_keep_the_samples_per_step_and_carry_deepspeeds_names() -> None:
    user = {"gradient_accumulation_steps": 2, "zero_optimization": {"stage": [0, 2], "overlap_comm": True}}
    exps = build_experiments(user, AutotuningSettings(), num_ranks=2, stages=[0, 2], micro_batches={0: [1, 4], 2: [4]})
    assert [e.name for e in exps] == ["z0_gas8_tmbspg1", "z0_gas2_tmbspg4", "z2_gas2_tmbspg4"]
    for exp in exps:  # 4 x 2 samples per rank per step, 2 ranks
        cfg = exp.ds_config
        assert (
            cfg["train_batch_size"]
            == 16
            == cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * 2
        )
        assert cfg["zero_optimization"] == {"stage": exp.stage, "overlap_comm": True}
    knobs = build_experiments(
        {"zero_optimization": {"reduce_bucket_size": [1e6, 2e6]}},
        AutotuningSettings(fast=False),
        num_ranks=1,
        stages=[1],
        micro_batches={1: [2]},
    )
    assert [e.name for e in knobs] == [
        "z1_gas1_tmbspg2_rbs1.0e+06_abs5.0e+07",
        "z1_gas1_tmbspg2_rbs1.0e+06_abs5.0e+08",
        "z1_gas1_tmbspg2_rbs1.0e+06_abs1.0e+09",
        "z1_gas1_tmbspg2_rbs2.0e+06_abs5.0e+07",
        "z1_gas1_tmbspg2_rbs2.0e+06_abs5.0e+08",
        "z1_gas1_tmbspg2_rbs2.0e+06_abs1.0e+09",
    ]
    assert knobs[4].ds_config["zero_optimization"] == {
        "stage": 1,
        "reduce_bucket_size": 2e6,
        "allgather_bucket_size": 5e8,
    }
