"""Sections of DeepSpeed features ds does not implement: every key accepted, the switch turning one on refused.

`compile` (DeepCompile) carries DeepSpeed 0.19.8's keys and defaults, so a
config written for DeepSpeed validates here key by key (a typo is an error with a suggestion), while a switch that turns
the feature on is refused by name, saying what ds does not do (`inert_keys`). Settings read only by a
feature that is off have no effect in DeepSpeed either and are accepted silently, except DeepCompile's
knobs, which warn (`ignored_keys`): both engines have `engine.compile()`, and ds's (torch.compile) reads
none of them, where a user may expect them to apply.
`expert_parallel` (AutoEP) is implemented (`_expert_parallel_section`) and re-exported here.

DeepSpeed acts on the sub-switches of `data_efficiency` (`curriculum_learning.enabled`,
`random_ltd.enabled`, ...) whatever the section's own `enabled` says, so each is checked on its own: data
sampling (curriculum learning, dynamic batching; `_data_sampling_section`) and data routing (random-LTD;
`_random_ltd_section`) are implemented.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from ds_comm import ConfigModel
from ds_engine.config._data_sampling_section import DataSamplingConfig
from ds_engine.config._expert_parallel_section import ExpertParallelConfig
from ds_engine.config._random_ltd_section import DataRoutingConfig

__all__ = [
    "CompileConfig",
    "DataEfficiencyConfig",
    "ExpertParallelConfig",
]

_NOT_IN_DS = "is not implemented in ds"


class CompileConfig(ConfigModel):
    """`compile`: DeepCompile's settings (DeepSpeed's `CompileConfig`)."""

    inert_keys: ClassVar[dict[str, str]] = {
        "deepcompile": f"DeepCompile {_NOT_IN_DS}; call engine.compile() or torch.compile on the model instead",
        "autoep_non_moe": f"compiling around AutoEP layers is a DeepCompile option; DeepCompile {_NOT_IN_DS}",
    }
    ignored_keys: ClassVar[dict[str, str]] = {
        name: "DeepCompile reads it, and DeepCompile is not implemented in ds"
        for name in (
            "free_activation",
            "free_activation_threshold",
            "offload_activation",
            "offload_activation_pin_memory",
            "offload_opt_states",
            "double_buffer",
            "symmetric_memory",
            "debug_log",
            "offload_parameters",
            "sync_before_reduce",
            "sync_after_reduce",
            "sync_before_allgather",
            "sync_after_allgather",
            "keep_int_input_tensors",
            "keep_all_input_tensors",
            "passes",
        )
    }

    deepcompile: bool = False
    """DeepCompile (compiler passes for ZeRO); only false is accepted."""
    autoep_non_moe: bool = False
    """Compile the parents of AutoEP layers only; only false is accepted."""
    free_activation: bool = False
    free_activation_threshold: int = 10485760
    offload_activation: bool = False
    offload_activation_pin_memory: bool = True
    offload_opt_states: bool = False
    double_buffer: bool = True
    symmetric_memory: bool = False
    debug_log: bool = False
    offload_parameters: bool = False
    sync_before_reduce: bool = False
    sync_after_reduce: bool = False
    sync_before_allgather: bool = False
    sync_after_allgather: bool = False
    keep_int_input_tensors: bool = True
    keep_all_input_tensors: bool = False
    passes: list[Literal["z1", "z3", "autosp", "autotp"]] | None = None


class DataEfficiencyConfig(ConfigModel):
    """`data_efficiency`: DeepSpeed's data efficiency library (data sampling and random-LTD data routing)."""

    enabled: bool = False
    """Reported by `engine.data_efficiency_enabled()`; as in DeepSpeed, the sub-switches act on their own."""
    seed: int = 1234
    data_sampling: DataSamplingConfig = DataSamplingConfig()
    data_routing: DataRoutingConfig = DataRoutingConfig()
