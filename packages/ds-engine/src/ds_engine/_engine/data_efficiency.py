"""The engine's face of DeepSpeed's data efficiency library: its config getters and random-LTD's wiring.

At construction the `data_efficiency` section becomes DeepSpeed's nested dict once
(`data_efficiency_config()`), and with `data_routing.random_ltd.enabled` the `RandomLTDScheduler` is
built over the `random_ltd` dict with `global_batch_size` / `micro_batch_size` filled in from the batch
triple (the dict keeps them, as DeepSpeed's does). After `initialize()`, `convert_to_random_ltd(engine,
LayerClass)` wraps the model's layers and calls `random_ltd_initialize()`, which hands the scheduler to
the wrappers listed in `random_ltd_layer_id`. Each training forward steps the scheduler to
`global_steps` (`_random_ltd_step`); checkpoints save its `state_dict()` under `random_ltd` and the module
weights under their names without the wrappers (see `Checkpointer`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ds_engine._data import keys as k
from ds_engine._data.ltd_helpers import add_random_ltd_names, remove_random_ltd_state_dict, wire_random_ltd
from ds_engine._data.ltd_scheduler import RandomLTDScheduler
from ds_engine._data.section import get_data_efficiency_config

if TYPE_CHECKING:
    from torch import nn

logger = logging.getLogger(__name__)

__all__ = ["EngineDataEfficiency"]


class EngineDataEfficiency:
    """Mixed into `DeepSpeedEngine`: the data efficiency getters, `random_ltd_initialize`, and the random-LTD step."""

    module: nn.Module
    training_dataloader: Any
    global_steps: int
    _data_efficiency: dict[str, Any]
    random_ltd_scheduler: RandomLTDScheduler | None

    def _init_data_efficiency(
        self, raw_config: dict[str, Any], *, train_batch_size: int, micro_batch_size: int
    ) -> None:
        self._data_efficiency = get_data_efficiency_config(raw_config)
        self.random_ltd_scheduler = None
        if self.random_ltd_enabled():
            ltd = self.random_ltd_config()
            ltd[k.RANDOM_LTD_GLOBAL_BATCH_SIZE] = train_batch_size
            ltd[k.RANDOM_LTD_MICRO_BATCH_SIZE] = micro_batch_size
            self.random_ltd_scheduler = RandomLTDScheduler(ltd)

    # -- DeepSpeed's getters ----------------------------------------------------------------------------
    def data_efficiency_enabled(self) -> bool:
        return bool(self._data_efficiency[k.DATA_EFFICIENCY_ENABLED])

    def data_efficiency_config(self) -> dict[str, Any]:
        """The `data_efficiency` section as DeepSpeed's nested dict (every part, defaults filled in)."""
        return self._data_efficiency

    def data_sampling_enabled(self) -> bool:
        return bool(self.data_sampling_config()[k.DATA_SAMPLING_ENABLED])

    def data_sampling_config(self) -> dict[str, Any]:
        return self._data_efficiency[k.DATA_SAMPLING]

    def curriculum_learning_enabled(self) -> bool:
        return bool(self.curriculum_learning_config()[k.CURRICULUM_LEARNING_ENABLED])

    def curriculum_learning_config(self) -> dict[str, Any]:
        return self.data_sampling_config()[k.CURRICULUM_LEARNING]

    def random_ltd_enabled(self) -> bool:
        return bool(self.random_ltd_config()[k.RANDOM_LTD_ENABLED])

    def random_ltd_config(self) -> dict[str, Any]:
        return self._data_efficiency[k.DATA_ROUTING][k.RANDOM_LTD]

    # -- hooks for scripts ------------------------------------------------------------------------------
    def random_ltd_initialize(self) -> None:
        """Hand the random-LTD scheduler to the model's `RandomLayerTokenDrop` layers listed in
        `random_ltd_layer_id` (`convert_to_random_ltd` calls this after wrapping).

        Raises:
            RuntimeError: random-LTD is not enabled in the config.
            ValueError: the wrapped layers found do not match `random_ltd_layer_num`.
        """
        if self.random_ltd_scheduler is None:
            raise RuntimeError(
                "random_ltd_initialize() needs random-LTD: set data_efficiency.data_routing.random_ltd.enabled "
                "to true (with its settings) in the config"
            )
        wire_random_ltd(self.module, self.random_ltd_config(), self.random_ltd_scheduler)

    def set_data_post_process_func(self, post_process_func: Callable[..., Any]) -> None:
        """`fn(batch, data_sampler_state_dict) -> batch`, applied by the training loader when curriculum data
        sampling drives it (DeepSpeed's hook; nothing happens without a training loader)."""
        if self.training_dataloader is not None:
            self.training_dataloader.post_process_func = post_process_func

    def set_custom_curriculum_learning_schedule(self, schedule_func_dict: dict[str, Callable[[int], Any]]) -> None:
        """`{metric: fn(step) -> difficulty}` for the curriculum metrics with `schedule_type: custom` (handed to the
        training loader's curriculum data sampler; nothing happens without one, as in DeepSpeed)."""
        if self.training_dataloader is not None and self.curriculum_learning_enabled():
            self.training_dataloader.data_sampler.set_custom_curriculum_learning_schedule(schedule_func_dict)

    # -- used by the engine -----------------------------------------------------------------------------
    def _random_ltd_step(self) -> None:
        """At a training forward: the kept length for this step."""
        if self.random_ltd_scheduler is not None and self.module.training:
            self.random_ltd_scheduler.update_seq(self.global_steps)

    def _without_random_ltd_names(self, state: dict[str, Any]) -> dict[str, Any]:
        """Module weights as saved: without the wrappers' `.random_ltd_layer` (DeepSpeed saves them so)."""
        return remove_random_ltd_state_dict(state) if self.random_ltd_enabled() else state

    def _with_random_ltd_names(self, state: dict[str, Any]) -> dict[str, Any]:
        """Saved module weights renamed onto the wrapped model (a strict load then matches every key)."""
        return add_random_ltd_names(state, self.module) if self.random_ltd_enabled() else state
