"""The `data_efficiency` section, and the re-export of `expert_parallel` (AutoEP, `_expert_parallel_section`).

This module once held the sections of features ds refused; `compile` (DeepCompile, `_compile_section`) and
`expert_parallel` now live in their own modules, and what remains is data efficiency's umbrella.
DeepSpeed acts on the sub-switches of `data_efficiency` (`curriculum_learning.enabled`,
`random_ltd.enabled`, ...) whatever the section's own `enabled` says, so each is checked on its own: data
sampling (curriculum learning, dynamic batching; `_data_sampling_section`) and data routing (random-LTD;
`_random_ltd_section`) are implemented.
"""

from __future__ import annotations

from ds_comm import ConfigModel
from ds_engine.config._data_sampling_section import DataSamplingConfig
from ds_engine.config._expert_parallel_section import ExpertParallelConfig
from ds_engine.config._random_ltd_section import DataRoutingConfig

__all__ = [
    "DataEfficiencyConfig",
    "ExpertParallelConfig",
]


class DataEfficiencyConfig(ConfigModel):
    """`data_efficiency`: DeepSpeed's data efficiency library (data sampling and random-LTD data routing)."""

    enabled: bool = False
    """Reported by `engine.data_efficiency_enabled()`; as in DeepSpeed, the sub-switches act on their own."""
    seed: int = 1234
    data_sampling: DataSamplingConfig = DataSamplingConfig()
    data_routing: DataRoutingConfig = DataRoutingConfig()
