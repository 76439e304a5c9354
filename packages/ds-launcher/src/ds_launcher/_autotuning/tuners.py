"""The tuners: in which order experiments run and when the search stops.

All three run one experiment at a time through `evaluate` (which launches it and returns its metric,
or None when it failed) and share the rules of `BaseTuner.tune`:

- at most `num_trials` experiments run;
- the search stops after `early_stopping` experiments in a row that did not beat the best so far;
- once a micro-batch size failed (out of memory, typically), larger sizes of the same stage and knobs
  are skipped without running: they need more memory still.

`GridSearchTuner` takes the space in its order (stage by stage, micro-batch size ascending);
`RandomTuner` in a random order from a seeded generator (the same order on every run);
`ModelBasedTuner` picks by a cost model: `RidgeCostModel`, a ridge regression of log(metric) on the
experiment's features (stage one-hot, log2 micro-batch size and its square, log2 accumulation steps, each
knob), refitted after every result. It starts from `INIT_NUM` random experiments, then runs the one the
model predicts best, exploring a random one instead with probability `EXPLORE`. DeepSpeed's model-based
tuner fits XGBoost (an optional dependency); a quadratic in log micro-batch size per stage already
describes the rise-then-plateau of throughput that the search is about, and needs nothing installed.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ds_launcher._autotuning.space import Experiment

logger = logging.getLogger(__name__)

__all__ = ["GridSearchTuner", "ModelBasedTuner", "RandomTuner", "RidgeCostModel", "Trial", "Tuner", "make_tuner"]

#: Random experiments the model-based tuner runs before it trusts its model.
INIT_NUM = 3
#: Chance that the model-based tuner explores a random experiment instead of the predicted best.
EXPLORE = 0.2

Evaluate = Callable[[Experiment], "float | None"]


@dataclass(frozen=True)
class Trial:
    """One experiment's outcome: its metric, or None with the reason (`failed` ran and broke; `skipped` did not run)."""

    experiment: Experiment
    metric: float | None
    status: str
    """"ok", "failed" or "skipped"."""


class Tuner:
    """The search loop; subclasses choose the next experiment.

    Args:
        experiments: the space, in grid order.
        higher_is_better: True for throughput and flops, False for latency.
        seed: seeds the random choices (random order, exploration).
    """

    def __init__(self, experiments: Sequence[Experiment], *, higher_is_better: bool = True, seed: int = 0) -> None:
        self.pending: list[Experiment] = list(experiments)
        self.higher_is_better = higher_is_better
        self.rng = random.Random(seed)
        self.trials: list[Trial] = []
        self.best: Trial | None = None
        self._failed_at: dict[tuple[int, tuple[tuple[str, object], ...]], int] = {}

    def next_experiment(self) -> Experiment:
        """Remove and return the next experiment to run (`pending` is not empty)."""
        raise NotImplementedError

    def observe(self, trial: Trial) -> None:
        """Learn from a finished experiment (the model-based tuner refits)."""

    def better(self, a: float, b: float) -> bool:
        return a > b if self.higher_is_better else a < b

    def _skip_reason(self, exp: Experiment) -> str | None:
        failed = self._failed_at.get((exp.stage, exp.knobs))
        if failed is not None and exp.micro_batch >= failed:
            return f"micro-batch size {failed} already failed at this stage and knobs"
        return None

    def tune(self, evaluate: Evaluate, *, num_trials: int, early_stopping: int | None) -> list[Trial]:
        """Run experiments until the space, `num_trials` or the patience (`early_stopping`) runs out.

        Returns:
            every trial in the order it was decided, skipped ones included.
        """
        ran = since_best = 0
        while self.pending and ran < num_trials:
            exp = self.next_experiment()
            reason = self._skip_reason(exp)
            if reason is not None:
                logger.info("autotuning: skipping %s: %s", exp.name, reason)
                self.trials.append(Trial(exp, None, "skipped"))
                continue
            metric = evaluate(exp)
            ran += 1
            trial = Trial(exp, metric, "ok" if metric is not None else "failed")
            self.trials.append(trial)
            if metric is None:
                key = (exp.stage, exp.knobs)
                self._failed_at[key] = min(self._failed_at.get(key, exp.micro_batch), exp.micro_batch)
                since_best += 1
            elif self.best is None or self.better(metric, self.best.metric):  # type: ignore[arg-type]
                self.best = trial
                since_best = 0
            else:
                since_best += 1
            self.observe(trial)
            if early_stopping and since_best >= early_stopping:
                logger.info("autotuning: stopping early: %d experiments without a better metric", since_best)
                break
        return self.trials


class GridSearchTuner(Tuner):
    """The space in its order: stage by stage, micro-batch size ascending, knobs in grid order."""

    def next_experiment(self) -> Experiment:
        return self.pending.pop(0)


class RandomTuner(Tuner):
    """The space in a seeded random order."""

    def next_experiment(self) -> Experiment:
        return self.pending.pop(self.rng.randrange(len(self.pending)))


class RidgeCostModel:
    """Ridge regression of log(metric) on standardized features, solved by the normal equations.

    Args:
        l2: the ridge penalty (on standardized features; the intercept is not penalized).
    """

    def __init__(self, l2: float = 1e-2) -> None:
        self.l2 = l2
        self._weights: list[float] | None = None
        self._mean: list[float] = []
        self._scale: list[float] = []

    def fit(self, xs: Sequence[Sequence[float]], ys: Sequence[float]) -> None:
        """Fit on feature rows `xs` and positive metrics `ys`."""
        d = len(xs[0])
        self._mean = [sum(row[j] for row in xs) / len(xs) for j in range(d)]
        spread = [math.sqrt(sum((row[j] - self._mean[j]) ** 2 for row in xs) / len(xs)) for j in range(d)]
        self._scale = [s if s > 1e-12 else 1.0 for s in spread]
        rows = [self._design(row) for row in xs]
        targets = [math.log(y) for y in ys]
        n = d + 1
        a = [
            [sum(r[i] * r[j] for r in rows) + (self.l2 if i == j and i > 0 else 0.0) for j in range(n)]
            for i in range(n)
        ]
        b = [sum(r[i] * t for r, t in zip(rows, targets, strict=True)) for i in range(n)]
        self._weights = _solve(a, b)

    def _design(self, row: Sequence[float]) -> list[float]:
        return [1.0, *((v - m) / s for v, m, s in zip(row, self._mean, self._scale, strict=True))]

    def predict(self, row: Sequence[float]) -> float:
        """The predicted metric (exp of the fitted log)."""
        assert self._weights is not None, "fit() first"
        return math.exp(sum(w * x for w, x in zip(self._weights, self._design(row), strict=True)))


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (a is symmetric positive definite thanks to the ridge)."""
    n = len(b)
    m = [row[:] + [rhs] for row, rhs in zip(a, b, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if abs(m[col][col]) < 1e-12:
            m[col][col] = 1e-12
        for r in range(col + 1, n):
            factor = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= factor * m[col][c]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


class ModelBasedTuner(Tuner):
    """Runs what `RidgeCostModel` predicts best after `INIT_NUM` random experiments (see the module docstring)."""

    def __init__(self, experiments: Sequence[Experiment], *, higher_is_better: bool = True, seed: int = 0) -> None:
        super().__init__(experiments, higher_is_better=higher_is_better, seed=seed)
        self.model = RidgeCostModel()
        self._xs: list[list[float]] = []
        self._ys: list[float] = []

    def next_experiment(self) -> Experiment:
        if len(self._ys) < INIT_NUM or self.rng.random() < EXPLORE:
            return self.pending.pop(self.rng.randrange(len(self.pending)))
        predicted = [self.model.predict(exp.features()) for exp in self.pending]
        pick = max if self.higher_is_better else min
        index = pick(range(len(predicted)), key=predicted.__getitem__)
        return self.pending.pop(index)

    def observe(self, trial: Trial) -> None:
        if trial.metric is None or trial.metric <= 0:
            return
        self._xs.append(trial.experiment.features())
        self._ys.append(trial.metric)
        self.model.fit(self._xs, self._ys)


TUNERS: dict[str, type[Tuner]] = {
    "gridsearch": GridSearchTuner,
    "random": RandomTuner,
    "model_based": ModelBasedTuner,
}


def make_tuner(tuner_type: str, experiments: Sequence[Experiment], *, higher_is_better: bool, seed: int = 0) -> Tuner:
    """The `autotuning.tuner_type` tuner over `experiments`."""
    return TUNERS[tuner_type](experiments, higher_is_better=higher_is_better, seed=seed)
