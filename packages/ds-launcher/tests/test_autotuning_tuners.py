"""The tuners' choice sequences on a synthetic metric table (no processes): grid order, a seeded random order,
the model-based tuner's cost model, early stopping, the trial budget, and skipping sizes above a failed one.

The table: log(throughput) = a[stage] + log2(mbs) - 0.12 log2(mbs)^2, which peaks at micro-batch 16 and is
best at stage 3; stage 0 runs out of memory from micro-batch 32 up (the metric is None there).
"""

from __future__ import annotations

import math

import pytest

from ds_launcher._autotuning.settings import AutotuningSettings
from ds_launcher._autotuning.space import Experiment, build_experiments
from ds_launcher._autotuning.tuners import GridSearchTuner, ModelBasedTuner, RandomTuner, RidgeCostModel, make_tuner

STAGE_OFFSET = {0: -0.5, 1: -0.2, 2: -0.1, 3: 0.0}
SIZES = [1, 2, 4, 8, 16, 32, 64]


def _space() -> list[Experiment]:
    return build_experiments(
        {}, AutotuningSettings(), num_ranks=2, stages=[0, 1, 2, 3], micro_batches={s: SIZES for s in range(4)}
    )


def _throughput(exp: Experiment) -> float | None:
    if exp.stage == 0 and exp.micro_batch >= 32:
        return None  # out of memory
    x = math.log2(exp.micro_batch)
    return math.exp(STAGE_OFFSET[exp.stage] + x - 0.12 * x * x)


def _names(trials) -> list[str]:
    return [t.experiment.name for t in trials]


def test_grid_runs_the_space_in_order_and_skips_sizes_above_a_failure() -> None:
    space = _space()
    trials = GridSearchTuner(space).tune(_throughput, num_trials=100, early_stopping=None)
    assert _names(trials) == [e.name for e in space]
    statuses = {t.experiment.name: t.status for t in trials}
    assert statuses["z0_gas2_tmbspg32"] == "failed"  # ran and broke
    assert statuses["z0_gas1_tmbspg64"] == "skipped"  # never launched: 32 already did not fit
    assert sum(t.status != "skipped" for t in trials) == len(space) - 1


def test_grid_early_stopping_and_the_trial_budget() -> None:
    tuner = GridSearchTuner(_space())
    trials = tuner.tune(_throughput, num_trials=100, early_stopping=3)
    # z0's best is mbs 16 (5th); then 32 fails, 64 is skipped, z1 mbs 1 and 2 are worse: three in a row
    assert _names(trials)[-1] == "z1_gas32_tmbspg2"
    assert tuner.best is not None and tuner.best.experiment.name == "z0_gas4_tmbspg16"
    assert len(GridSearchTuner(_space()).tune(_throughput, num_trials=4, early_stopping=None)) == 4


def test_random_order_is_a_seeded_permutation() -> None:
    space = _space()
    first = _names(RandomTuner(space, seed=0).tune(_throughput, num_trials=100, early_stopping=None))
    again = _names(RandomTuner(space, seed=0).tune(_throughput, num_trials=100, early_stopping=None))
    other = _names(RandomTuner(space, seed=1).tune(_throughput, num_trials=100, early_stopping=None))
    assert first == again and first != other
    assert sorted(first) == sorted(e.name for e in space) and first != [e.name for e in space]


def test_ridge_cost_model_recovers_a_log_quadratic() -> None:
    space = [e for e in _space() if _throughput(e) is not None]
    model = RidgeCostModel(l2=1e-6)
    model.fit([e.features() for e in space[::2]], [_throughput(e) for e in space[::2]])
    for exp in space[1::2]:
        assert model.predict(exp.features()) == pytest.approx(_throughput(exp), rel=1e-3)


def test_model_based_finds_the_best_where_the_patient_grid_gives_up() -> None:
    """The best is at the last stage the grid visits; with the same patience (5) the grid stops at stage 1."""
    space = _space()
    model_based = ModelBasedTuner(space, seed=0)
    ran = [t.experiment.name for t in model_based.tune(_throughput, num_trials=100, early_stopping=5)]
    assert ran == [
        "z3_gas1_tmbspg64",  # three random experiments to start from
        "z1_gas2_tmbspg32",
        "z3_gas4_tmbspg16",  # the third is already the best; five more fail to beat it
        "z3_gas64_tmbspg1",
        "z2_gas8_tmbspg8",
        "z2_gas4_tmbspg16",
        "z3_gas2_tmbspg32",
        "z0_gas4_tmbspg16",
    ]
    assert model_based.best is not None and model_based.best.experiment.name == "z3_gas4_tmbspg16"
    grid = GridSearchTuner(space)
    grid_ran = [t for t in grid.tune(_throughput, num_trials=100, early_stopping=5) if t.status != "skipped"]
    assert grid.best is not None and grid.best.experiment.name == "z1_gas4_tmbspg16"
    assert len(grid_ran) == 16 > len(ran)


def test_latency_is_minimized() -> None:
    def latency(exp: Experiment) -> float | None:
        value = _throughput(exp)
        return None if value is None else 1.0 / value

    for kind in ("gridsearch", "random", "model_based"):
        tuner = make_tuner(kind, _space(), higher_is_better=False)
        tuner.tune(latency, num_trials=100, early_stopping=None)
        assert tuner.best is not None and tuner.best.experiment.name == "z3_gas4_tmbspg16", kind
