"""`RandomLTDScheduler`: how many tokens the random-LTD layers keep at each step, and the layer-tokens consumed.

Random layerwise token dropping (random-LTD) runs some transformer layers on a random subset of each
sequence's tokens; the subset grows from `min_value` to `max_value` tokens over `require_steps` steps
(`fixed_linear`, in multiples of `seq_per_step`), after which every layer sees every token. The
engine calls `update_seq(global_steps)` at each training forward; the count of layer-tokens processed so
far (`consumed_layer_tokens`, what a layer-token based lr schedule would follow) grows once per step:
`global_batch_size * (kept * random_ltd_layer_num + max_value * (total_layer_num - random_ltd_layer_num))`.

The config is DeepSpeed's `random_ltd` dict with `global_batch_size` (and `micro_batch_size`) filled in
by the engine; the state lives in `state` under DeepSpeed's keys and `state_dict()` holds what a
checkpoint saves under `random_ltd`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ds_engine._data import keys as k
from ds_engine._data.root_schedule import root_value

logger = logging.getLogger(__name__)

__all__ = ["BaseScheduler", "RandomLTDScheduler"]

_PATH = "data_efficiency.data_routing.random_ltd"

#: What `state_dict()` saves (the rest of `state` comes from the config, or is per-forward scratch).
_SAVED = (
    k.RANDOM_LTD_CONSUMED_LAYER_TOKENS,
    k.RANDOM_LTD_CURR_STEP,
    k.RANDOM_LTD_CURRENT_VALUE,
    k.RANDOM_LTD_MIN_VALUE,
    k.RANDOM_LTD_MAX_VALUE,
)


class BaseScheduler:
    """A value schedule over steps kept in `state` (`min_value`, `max_value`, `schedule_type`, `schedule_config`)."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}

    def get_value(self, global_steps: int) -> Any:
        """The scheduled value at `global_steps`; `fixed_linear` is the one schedule DeepSpeed 0.19.8 has."""
        kind = self.state[k.RANDOM_LTD_SCHEDULER_TYPE]
        if kind != "fixed_linear":
            raise ValueError(
                f"{_PATH}.{k.RANDOM_LTD_SCHEDULER}.{k.RANDOM_LTD_SCHEDULER_TYPE}={kind!r} is not supported; "
                "use 'fixed_linear'"
            )
        schedule = self.state[k.RANDOM_LTD_SCHEDULE_CONFIG]
        return root_value(
            global_steps,
            total_steps=schedule[k.RANDOM_LTD_REQUIRE_STEP],
            degree=1,
            low=self.state[k.RANDOM_LTD_MIN_VALUE],
            high=self.state[k.RANDOM_LTD_MAX_VALUE],
            multiple=schedule[k.RANDOM_LTD_INCREASE_STEP],
            floor_at_min=False,
        )


class RandomLTDScheduler(BaseScheduler):
    """Kept sequence length per step for the random-LTD layers (DeepSpeed's `RandomLTDScheduler`).

    Args:
        config: the `random_ltd` section as a dict, with `global_batch_size` set (the engine does that).

    Raises:
        ValueError: `layer_token_lr_schedule.enabled` (the layer-token lr schedule is not implemented, in
            DeepSpeed either), or a key the schedule needs is missing.
    """

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        for key in (k.RANDOM_LTD_TOTAL_LAYER_NUM, k.RANDOM_LTD_LAYER_NUM, k.RANDOM_LTD_SCHEDULER):
            if config.get(key) is None:
                raise ValueError(f"{_PATH}.{key} is required with random-LTD enabled")
        if k.RANDOM_LTD_GLOBAL_BATCH_SIZE not in config:
            raise ValueError(
                f"RandomLTDScheduler: config[{k.RANDOM_LTD_GLOBAL_BATCH_SIZE!r}] is missing; the engine sets it "
                "to train_batch_size (build the scheduler through deepspeed.initialize, or set it yourself)"
            )
        lr_schedule = config.get(k.RANDOM_LTD_LAYER_TOKEN_LR_SCHEDULE) or {}
        if lr_schedule.get(k.RANDOM_LTD_LAYER_TOKEN_LR_ENABLED, False):
            raise ValueError(
                f"{_PATH}.{k.RANDOM_LTD_LAYER_TOKEN_LR_SCHEDULE}.enabled=true is not supported: the layer-token "
                "lr schedule is not implemented (DeepSpeed 0.19.8 raises NotImplementedError too); leave it off"
            )
        self.model_layer_num: int = config[k.RANDOM_LTD_TOTAL_LAYER_NUM]
        self.random_ltd_layer_num: int = config[k.RANDOM_LTD_LAYER_NUM]
        self.config_schedule: Mapping[str, Any] = config[k.RANDOM_LTD_SCHEDULER]
        self.global_batch_size: int = config[k.RANDOM_LTD_GLOBAL_BATCH_SIZE]
        self.reset_to_init()

    def reset_to_init(self) -> None:
        """Back to the first step: the kept length at `min_value`, nothing consumed."""
        schedule = self.config_schedule
        self.state[k.RANDOM_LTD_MIN_VALUE] = schedule[k.RANDOM_LTD_MIN_VALUE]
        self.state[k.RANDOM_LTD_MAX_VALUE] = schedule[k.RANDOM_LTD_MAX_VALUE]
        self.state[k.RANDOM_LTD_CURRENT_VALUE] = schedule[k.RANDOM_LTD_MIN_VALUE]
        self.state[k.RANDOM_LTD_SCHEDULE_CONFIG] = schedule[k.RANDOM_LTD_SCHEDULE_CONFIG]
        self.state[k.RANDOM_LTD_SCHEDULER_TYPE] = schedule[k.RANDOM_LTD_SCHEDULER_TYPE]
        self.state[k.RANDOM_LTD_CONSUMED_LAYER_TOKENS] = 0
        self.state[k.RANDOM_LTD_CURR_STEP] = -1

    def update_seq(self, global_steps: int) -> None:
        """Set the kept length for `global_steps` (until it reached `max_value`); count the step's layer-tokens
        once however many forwards (micro-batches) the step has."""
        state = self.state
        if state[k.RANDOM_LTD_CURRENT_VALUE] < state[k.RANDOM_LTD_MAX_VALUE]:
            state[k.RANDOM_LTD_CURRENT_VALUE] = self.get_value(global_steps)
        if global_steps != state[k.RANDOM_LTD_CURR_STEP]:
            dropped_layers = self.random_ltd_layer_num
            full_layers = self.model_layer_num - dropped_layers
            per_sample = (
                state[k.RANDOM_LTD_CURRENT_VALUE] * dropped_layers + state[k.RANDOM_LTD_MAX_VALUE] * full_layers
            )
            state[k.RANDOM_LTD_CONSUMED_LAYER_TOKENS] += self.global_batch_size * per_sample
            state[k.RANDOM_LTD_CURR_STEP] = global_steps

    def get_total_layer_tokens(self, train_iters: int) -> int:
        """Layer-tokens consumed after stepping through `train_iters` steps from the current state."""
        for step in range(train_iters):
            self.update_seq(step)
        return self.state[k.RANDOM_LTD_CONSUMED_LAYER_TOKENS]

    def get_current_seq(self) -> Any:
        """Tokens each random-LTD layer keeps now."""
        return self.state[k.RANDOM_LTD_CURRENT_VALUE]

    def set_current_seq(self, seq_length: Any) -> None:
        self.state[k.RANDOM_LTD_CURRENT_VALUE] = seq_length

    def get_random_ltd_layer_num(self) -> int:
        return self.random_ltd_layer_num

    def get_state(self) -> dict[str, Any]:
        return self.state

    def set_state(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint saves under `random_ltd` (DeepSpeed's five keys)."""
        return {key: self.state[key] for key in _SAVED}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        missing = [key for key in _SAVED if key not in state_dict]
        if missing:
            raise ValueError(
                f"random-LTD scheduler state: keys {missing} are missing from the checkpoint's 'random_ltd'"
            )
        for key in _SAVED:
            self.state[key] = state_dict[key]
