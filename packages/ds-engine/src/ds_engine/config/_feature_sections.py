"""Sections of DeepSpeed features ds does not implement: every key accepted, the switch turning one on refused.

`compile` (DeepCompile), `autotuning`, `data_efficiency.data_sampling` (curriculum data sampling, dynamic
batching) and `expert_parallel` (AutoEP) carry DeepSpeed 0.19.8's keys and defaults, so a config written
for DeepSpeed validates here key by key (a typo is an error with a suggestion), while a switch that turns
the feature on is refused by name, saying what ds does not do (`inert_keys`). Settings read only by a
feature that is off have no effect in DeepSpeed either and are accepted silently, except DeepCompile's
knobs, which warn (`ignored_keys`): both engines have `engine.compile()`, and ds's (torch.compile) reads
none of them, where a user may expect them to apply.

DeepSpeed acts on the sub-switches of `data_efficiency` (`curriculum_learning.enabled`,
`random_ltd.enabled`, ...) whatever the section's own `enabled` says, so each is refused on its own;
`data_routing.random_ltd` is implemented (`_random_ltd_section`).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from ds_comm import ConfigModel
from ds_engine.config._random_ltd_section import DataRoutingConfig

__all__ = [
    "AutotuningConfig",
    "CompileConfig",
    "DataEfficiencyConfig",
    "ExpertParallelConfig",
]

_NOT_IN_DS = "is not implemented in ds"
_DATA_EFFICIENCY = f"DeepSpeed's data efficiency data sampling {_NOT_IN_DS}"


class CompileConfig(ConfigModel):
    """`compile`: DeepCompile's settings (DeepSpeed's `CompileConfig`)."""

    inert_keys: ClassVar[dict[str, str]] = {
        "deepcompile": f"DeepCompile {_NOT_IN_DS}; call engine.compile() or torch.compile on the model instead",
        "autoep_non_moe": f"compiling around AutoEP layers needs AutoEP, which {_NOT_IN_DS}",
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


class AutotuningModelInfo(ConfigModel):
    """`autotuning.model_info`."""

    profile: bool = False
    num_params: int | None = None
    hidden_size: int | None = None
    num_layers: int | None = None


class AutotuningConfig(ConfigModel):
    """`autotuning`: DeepSpeed's autotuner (launched with `deepspeed --autotuning`)."""

    inert_keys: ClassVar[dict[str, str]] = {"enabled": f"the autotuner {_NOT_IN_DS}"}

    enabled: bool = False
    """Profile the steps the autotuner asks for; only false is accepted."""
    fast: bool = True
    results_dir: str = "autotuning_results"
    exps_dir: str = "autotuning_exps"
    overwrite: bool = True
    start_profile_step: int = 3
    end_profile_step: int = 5
    metric: str = "throughput"
    metric_path: str | None = None
    tuner_type: str = "gridsearch"
    tuner_early_stopping: int = 5
    tuner_num_trials: int = 50
    arg_mappings: dict[str, str] | None = None
    model_info: AutotuningModelInfo | None = None
    model_info_path: str | None = None
    mp_size: int = 1
    max_train_batch_size: int | None = None
    min_train_batch_size: int = 1
    max_train_micro_batch_size_per_gpu: int = 1024
    min_train_micro_batch_size_per_gpu: int = 1
    num_tuning_micro_batch_sizes: int = 3


class CurriculumLearningConfig(ConfigModel):
    """`data_efficiency.data_sampling.curriculum_learning`."""

    inert_keys: ClassVar[dict[str, str]] = {"enabled": f"curriculum learning ({_DATA_EFFICIENCY})"}

    enabled: bool = False
    data_cluster_path: str | None = None
    curriculum_metrics: dict[str, Any] = {}
    """Metric name -> its index paths, difficulty type and schedule."""


class DynamicBatchingConfig(ConfigModel):
    """`data_efficiency.data_sampling.dynamic_batching`."""

    inert_keys: ClassVar[dict[str, str]] = {"enabled": f"dynamic batching ({_DATA_EFFICIENCY})"}

    enabled: bool = False
    metrics_path: str | None = None
    lr_scaling_method: str = "linear"
    min_batch_size: int = 1
    max_batch_size: int | None = None
    sequence_picking_order: str = "dataloader"
    max_tokens: int | None = None
    verbose: bool = False


class DataSamplingConfig(ConfigModel):
    """`data_efficiency.data_sampling`."""

    inert_keys: ClassVar[dict[str, str]] = {"enabled": f"data sampling ({_DATA_EFFICIENCY})"}

    enabled: bool = False
    num_epochs: int = 1000
    num_workers: int = 0
    pin_memory: bool = False
    curriculum_learning: CurriculumLearningConfig = CurriculumLearningConfig()
    dynamic_batching: DynamicBatchingConfig = DynamicBatchingConfig()


class DataEfficiencyConfig(ConfigModel):
    """`data_efficiency`: DeepSpeed's data efficiency library (curriculum learning, random-LTD)."""

    enabled: bool = False
    """Reported by the engine only; each part's own switch acts (as in DeepSpeed)."""
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
