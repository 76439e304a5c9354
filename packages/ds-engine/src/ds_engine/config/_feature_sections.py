"""Sections of DeepSpeed features ds does not implement: every key accepted, the switch turning one on refused.

`expert_parallel` (AutoEP) carries DeepSpeed 0.19.8's keys and defaults, so a config written for
DeepSpeed validates here key by key (a typo is an error with a suggestion), while the switch that turns
the feature on is refused by name, saying what ds does not do (`inert_keys`). Settings read only by a
feature that is off have no effect in DeepSpeed either and are accepted silently. (`compile`, DeepCompile,
is implemented: `_compile_section`.)

DeepSpeed acts on the sub-switches of `data_efficiency` (`curriculum_learning.enabled`,
`random_ltd.enabled`, ...) whatever the section's own `enabled` says, so each is checked on its own: data
sampling (curriculum learning, dynamic batching; `_data_sampling_section`) and data routing (random-LTD;
`_random_ltd_section`) are implemented.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from ds_comm import ConfigModel
from ds_engine.config._data_sampling_section import DataSamplingConfig
from ds_engine.config._random_ltd_section import DataRoutingConfig

__all__ = [
    "DataEfficiencyConfig",
    "ExpertParallelConfig",
]

_NOT_IN_DS = "is not implemented in ds"


class DataEfficiencyConfig(ConfigModel):
    """`data_efficiency`: DeepSpeed's data efficiency library (data sampling and random-LTD data routing)."""

    enabled: bool = False
    """Reported by `engine.data_efficiency_enabled()`; as in DeepSpeed, the sub-switches act on their own."""
    seed: int = 1234
    data_sampling: DataSamplingConfig = DataSamplingConfig()
    data_routing: DataRoutingConfig = DataRoutingConfig()


class ExpertParallelConfig(ConfigModel):
    """`expert_parallel`: DeepSpeed 0.19.8's AutoEP, which swaps a Hugging Face model's MoE blocks for its
    own expert-parallel layers at initialize().

    ds implements expert parallelism through the MoE layer (`deepspeed.moe.layer.MoE(..., ep_size=N)`, from
    ds-parallel), whose groups initialize() builds; the automatic replacement is what it does not do.
    """

    inert_keys: ClassVar[dict[str, str]] = {
        "enabled": "AutoEP, the automatic replacement of a Hugging Face model's MoE blocks by expert-parallel "
        f"layers, {_NOT_IN_DS}; build the model with deepspeed.moe.layer.MoE(..., ep_size=N) for expert "
        "parallelism instead",
    }

    enabled: bool = False
    """Replace the model's MoE blocks at initialize(); only false is accepted."""
    autoep_size: int = 1
    expert_tensor_parallel_size: int = 1
    validate_folding_routing: bool = False
    async_split_plan: bool = False
    preset_model: str | None = None
    moe_layer_pattern: str | None = None
    expert_pattern: str | None = None
    router_pattern: str | None = None
    use_grouped_mm: bool = True
    disable_triton_grouped_mm: bool = False
    route_norm: bool | None = None
    route_scale: float = 1.0
    score_apply: str = "auto"
    combine_impl: str = "auto"
    row_weighting_impl: str = "auto"
    gate_up_impl: str = "separate"
    comm_backend: str = "comm"
    comm_num_sm: int = 12
    comm_qp_margin: int = 4
    comm_max_tokens_per_rank: int = 0
    num_expert_groups: int | None = None
    num_limited_groups: int | None = None
    score_func: str = "auto"
    top_k: int | Literal["auto"] = "auto"
    load_balance_coeff: None = None
    """DeepSpeed refuses any value but null."""
    routed_scaling_factor: float | Literal["auto"] = "auto"
    expert_w1: str | None = None
    expert_w2: str | None = None
    expert_w3: str | None = None
    num_experts_attr: str | None = None
    top_k_attr: str | None = None
    has_shared_experts: bool | None = None
    shared_experts_pattern: str | None = None
    shared_experts_gate_pattern: str | None = None
    expert_activation: str | None = None

    #: keys whose "auto" is DeepSpeed's own value (resolved from the model), not a placeholder to fill
    literal_auto: ClassVar[tuple[str, ...]] = (
        "score_apply",
        "combine_impl",
        "row_weighting_impl",
        "score_func",
        "top_k",
        "routed_scaling_factor",
    )
