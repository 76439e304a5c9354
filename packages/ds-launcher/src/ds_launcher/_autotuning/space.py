"""The search space: which ZeRO stages, micro-batch sizes and ZeRO knobs the experiments try.

What is tuned (everything else in the user's ds_config is copied into every experiment as written):

- `zero_optimization.stage`: an int (that stage), a list, or `"all"` (0-3); absent: stage 0.
- `train_micro_batch_size_per_gpu`: a list is tried as given. Otherwise ds tries a ladder that doubles
  from the config's micro-batch size (or `min_train_micro_batch_size_per_gpu`), with
  `num_tuning_micro_batch_sizes` rungs, none above `max_train_micro_batch_size_per_gpu`, the bound from
  `max_train_batch_size`, nor the memory bound from the model profile (see `memory_bound`). DeepSpeed
  instead searches for the largest size that fits and tries sizes below it; on CPU hosts, where the bound
  is the host's memory, that spends its experiments on sizes far past the point where throughput stops
  growing.
- with `fast: false`, each stage's ZeRO knobs (`STAGE_KNOBS`, DeepSpeed's default tuning spaces); a
  list in the user's `zero_optimization` replaces a knob's values, a single value fixes it.

Every experiment keeps the same number of samples per rank per optimizer step, as DeepSpeed does:
`gradient_accumulation_steps = samples_per_rank // micro_batch` (at least 1), where `samples_per_rank` is
`max_train_batch_size * mp_size / ranks` when set, else the largest micro-batch size tried times the
config's `gradient_accumulation_steps`; `train_batch_size` follows.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ds_comm import ConfigError
from ds_launcher._autotuning.settings import AutotuningSettings

__all__ = [
    "STAGE_KNOBS",
    "Experiment",
    "build_experiments",
    "candidate_micro_batches",
    "candidate_stages",
    "instantiation_bytes",
    "memory_bound",
]

#: DeepSpeed 0.19.8's default ZeRO tuning spaces (tried with `fast: false`).
STAGE_KNOBS: dict[int, dict[str, list[Any]]] = {
    0: {},
    1: {"reduce_bucket_size": [5e7, 5e8, 1e9], "allgather_bucket_size": [5e7, 5e8, 1e9]},
    2: {
        "overlap_comm": [True, False],
        "reduce_scatter": [False, True],
        "reduce_bucket_size": [5e7, 5e8, 1e9],
        "allgather_bucket_size": [5e7, 5e8, 1e9],
        "contiguous_gradients": [False, True],
    },
    3: {
        "overlap_comm": [True, False],
        "reduce_scatter": [False, True],
        "reduce_bucket_size": [5e7, 5e8, 1e9],
        "allgather_partitions": [True, False],
        "allgather_bucket_size": [5e7, 5e8, 1e9],
        "contiguous_gradients": [False, True],
    },
}


@dataclass(frozen=True)
class Experiment:
    """One candidate config: its name (DeepSpeed's `z<stage>_gas<G>_tmbspg<M>[_<knobs>]`) and its ds_config."""

    name: str
    stage: int
    micro_batch: int
    gas: int
    knobs: tuple[tuple[str, Any], ...] = ()
    """The tuned ZeRO keys and their values in this experiment."""
    ds_config: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def features(self) -> list[float]:
        """Numbers the model-based tuner's regression reads (see `tuners.RidgeCostModel`)."""
        log_mbs = math.log2(self.micro_batch)
        out = [float(self.stage == s) for s in (1, 2, 3)]
        out += [log_mbs, log_mbs * log_mbs, math.log2(self.gas)]
        for _, value in self.knobs:
            out.append(float(value) if isinstance(value, bool) else math.log10(float(value) + 1.0))
        return out


def candidate_stages(user_config: dict[str, Any]) -> list[int]:
    """The stages to try, from `zero_optimization.stage` (int, list, or "all").

    Raises:
        ConfigError: a stage outside 0-3, or a value of another kind.
    """
    zero = user_config.get("zero_optimization") or {}
    value = zero.get("stage", 0) if isinstance(zero, dict) else 0
    stages = [0, 1, 2, 3] if value == "all" else value if isinstance(value, list) else [value]
    for stage in stages:
        if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage <= 3:
            raise ConfigError(
                f'zero_optimization.stage: {value!r}: autotuning tries an int 0-3, a list of them, or "all"'
            )
    return sorted(set(stages))


def instantiation_bytes(num_params: int, stage: int, *, num_ranks: int, half: bool, mp_size: int = 1) -> float:
    """Bytes per rank of parameters, gradients and Adam states at `stage` (DeepSpeed's estimate)."""
    params: float = num_params * (2 if half else 4)
    grads: float = num_params * (2 if half else 4)
    optim: float = num_params * (16 if half else 8)
    if stage >= 1:
        optim /= num_ranks
    if stage >= 2:
        grads /= num_ranks
    if stage >= 3:
        params /= num_ranks
    return (params + grads + optim) / mp_size


def memory_bound(
    model_info: dict[str, Any] | None, stage: int, *, memory_per_rank: float, num_ranks: int, half: bool, mp_size: int
) -> int | None:
    """The largest micro-batch size whose activations fit beside the model states (None: unknown)."""
    if not model_info or not model_info.get("num_params") or not model_info.get("activation_mem_per_gpu"):
        return None
    free = memory_per_rank - instantiation_bytes(
        int(model_info["num_params"]), stage, num_ranks=num_ranks, half=half, mp_size=mp_size
    )
    return max(int(free // int(model_info["activation_mem_per_gpu"])), 0)


def candidate_micro_batches(
    user_config: dict[str, Any], settings: AutotuningSettings, *, num_ranks: int, bound: int | None = None
) -> list[int]:
    """The micro-batch sizes to try (see the module docstring); may be empty when nothing fits.

    Raises:
        ConfigError: a listed size that is not a positive int.
    """
    value = user_config.get("train_micro_batch_size_per_gpu")
    if isinstance(value, list):
        for mbs in value:
            if isinstance(mbs, bool) or not isinstance(mbs, int) or mbs <= 0:
                raise ConfigError(f"train_micro_batch_size_per_gpu: {value!r}: every size to try must be an int > 0")
        return sorted(set(value))
    top = settings.max_train_micro_batch_size_per_gpu
    if settings.max_train_batch_size is not None:
        top = min(top, settings.max_train_batch_size * settings.mp_size // num_ranks)
    if bound is not None:
        top = min(top, bound)
    start = value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
    mbs = max(start or settings.min_train_micro_batch_size_per_gpu, 1)
    ladder: list[int] = []
    while mbs <= top and len(ladder) < settings.num_tuning_micro_batch_sizes:
        ladder.append(mbs)
        mbs *= 2
    return ladder


def _knob_values(stage: int, user_zero: dict[str, Any], fast: bool) -> dict[str, list[Any]]:
    if fast:
        return {}
    space = {}
    for key, values in STAGE_KNOBS[stage].items():
        given = user_zero.get(key, values)
        space[key] = list(given) if isinstance(given, list) else [given]
    return space


def _short(key: str, value: Any) -> str:
    acronym = "".join(word[0] for word in key.split("_"))
    if isinstance(value, bool):
        return f"{acronym}{'T' if value else 'F'}"
    if isinstance(value, int | float) and value > 9000:
        return f"{acronym}{value:.1e}"
    return f"{acronym}{value}"


def _gas_of(user_config: dict[str, Any]) -> int:
    gas = user_config.get("gradient_accumulation_steps", 1)
    return gas if isinstance(gas, int) and not isinstance(gas, bool) and gas > 0 else 1


def build_experiments(
    user_config: dict[str, Any],
    settings: AutotuningSettings,
    *,
    num_ranks: int,
    stages: Sequence[int],
    micro_batches: dict[int, list[int]],
) -> list[Experiment]:
    """Every experiment of the space, stage by stage, micro-batch size ascending, knobs in grid order.

    Args:
        user_config: the user's ds_config (lists and "all" where tuned).
        settings: the `autotuning` section.
        num_ranks: ranks of one experiment (nodes x ranks per node).
        stages: the stages to try.
        micro_batches: stage -> micro-batch sizes to try at that stage.
    """
    dp = max(num_ranks // settings.mp_size, 1)
    tried = [m for s in stages for m in micro_batches.get(s, [])]
    if settings.max_train_batch_size is not None:
        per_rank = max(settings.max_train_batch_size * settings.mp_size // num_ranks, 1)
    else:
        per_rank = max(tried, default=1) * _gas_of(user_config)
    user_zero = user_config.get("zero_optimization") or {}
    experiments = []
    for stage in stages:
        knob_space = _knob_values(stage, user_zero, settings.fast)
        keys = list(knob_space)
        for mbs in micro_batches.get(stage, []):
            gas = max(per_rank // mbs, 1)
            for combo in itertools.product(*(knob_space[k] for k in keys)):
                knobs = tuple(zip(keys, combo, strict=True))
                config = copy.deepcopy(user_config)
                zero = {k: v for k, v in user_zero.items() if not isinstance(v, list)}
                zero.update({"stage": stage, **dict(knobs)})
                config["zero_optimization"] = zero
                config["train_micro_batch_size_per_gpu"] = mbs
                config["gradient_accumulation_steps"] = gas
                config["train_batch_size"] = mbs * gas * dp
                name = "_".join([f"z{stage}_gas{gas}_tmbspg{mbs}", *(_short(k, v) for k, v in knobs)])
                experiments.append(Experiment(name, stage, mbs, gas, knobs, config))
    return experiments
