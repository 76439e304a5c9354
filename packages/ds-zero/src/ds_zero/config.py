"""`ZeroConfig`: the `zero_optimization` section, with DeepSpeed's keys, defaults and legacy aliases."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from ds_comm import ConfigDeprecationWarning, ConfigModel
from ds_zero._weight_quant_config import QuantizedInitializationConfig, WeightQuantizationConfig
from ds_zero._zenflow_config import ZenFlowConfig

__all__ = [
    "LeafModuleConfig",
    "OffloadDevice",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "QuantizedInitializationConfig",
    "WeightQuantizationConfig",
    "ZenFlowConfig",
    "ZeroConfig",
]

OffloadDevice = Literal["none", "cpu", "nvme"]

#: DeepSpeed's logger name. Deprecation notices DeepSpeed states at config validation go there as well,
#: where migrated tooling watches for them; the engine's `warn_ignored` still reports an ignored key as a
#: `UserWarning` naming its key path.
_DEEPSPEED_LOGGER = logging.getLogger("DeepSpeed")

# Field name -> the `stage3_`-prefixed spelling most DeepSpeed configs use. Either is accepted, not both.
_STAGE3_ALIASES = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "model_persistence_threshold": "stage3_model_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "module_granularity_threshold": "stage3_module_granularity_threshold",
    "use_all_reduce_for_fetch_params": "stage3_use_all_reduce_for_fetch_params",
    "allgather_sequential": "stage3_allgather_sequential",
}


class OffloadParamConfig(ConfigModel):
    """`zero_optimization.offload_param`: where stage-3 parameter partitions live between uses."""

    device: OffloadDevice = "none"
    """"cpu" keeps partitions in host memory; "nvme" swaps them to `nvme_path`."""
    nvme_path: Path | None = None
    """Directory for NVMe swap files (required with device "nvme")."""
    buffer_count: int = Field(5, ge=0)
    """Pinned buffers for NVMe reads."""
    buffer_size: int = Field(100_000_000, ge=0)
    """Elements per NVMe buffer."""
    max_in_cpu: int = Field(1_000_000_000, ge=0)
    """Elements kept in CPU memory before swapping to NVMe."""
    pin_memory: bool = True
    """Page-lock host buffers for faster device copies (no effect on CPU-only hosts)."""

    @model_validator(mode="after")
    def _nvme_needs_path(self) -> OffloadParamConfig:
        if self.device == "nvme" and self.nvme_path is None:
            raise ValueError('device "nvme" needs nvme_path (a directory on a fast local disk)')
        return self


class OffloadOptimizerConfig(ConfigModel):
    """`zero_optimization.offload_optimizer`: fp32 master weights and optimizer state off the device."""

    device: OffloadDevice = "none"
    """"cpu": state in host memory and the step on the CPU (DeepSpeedCPUAdam); "nvme": swapped to disk."""
    nvme_path: Path | None = None
    """Directory for NVMe swap files (required with device "nvme")."""
    buffer_count: int = Field(4, ge=0)
    """Pinned buffers for NVMe swapping."""
    pin_memory: bool = True
    """Page-lock host buffers (no effect on CPU-only hosts)."""
    pipeline_read: bool = False
    """Overlap NVMe reads of the next sub-group with the step."""
    pipeline_write: bool = False
    """Overlap NVMe writes of the previous sub-group with the step."""
    fast_init: bool = False
    """Skip the NVMe swap warm-up at init."""
    ratio: float = Field(1.0, ge=0.0, le=1.0)
    """Share of the sub-groups (`sub_group_size` tiles, counted in the optimizer's order) whose fp32 master and
    optimizer state are offloaded to the CPU; the first `int((1 - ratio) * n)` stay on the accelerator and are
    stepped there. Below 1 only with stage 3 and device "cpu" (`ds_zero._stage3.partial_offload`)."""
    super_offload: bool = False
    """SuperOffload: each CPU sub-group is stepped during the backward as soon as its gradient is complete, on a
    worker thread, and undone when the step is skipped or clipped (stage 3 with device "cpu";
    `ds_zero._stage3.superoffload`)."""
    cpuadam_cores_perc: float = Field(0.8, ge=0.0, le=1.0)
    """With `super_offload`: share of the host's cores the CPU optimizer's worker uses (0 < value <= 1)."""

    @model_validator(mode="after")
    def _nvme_needs_path(self) -> OffloadOptimizerConfig:
        if self.device == "nvme" and self.nvme_path is None:
            raise ValueError('device "nvme" needs nvme_path (a directory on a fast local disk)')
        return self

    @property
    def pipeline(self) -> bool:
        """Whether NVMe swapping is pipelined at all."""
        return self.pipeline_read or self.pipeline_write


#: What an absent offload section reads as (frozen models, so one shared instance each is safe).
_NO_PARAM_OFFLOAD = OffloadParamConfig()
_NO_OPTIMIZER_OFFLOAD = OffloadOptimizerConfig()


#: The Hugging Face MoE blocks DeepSpeed 0.19.8 makes ZeRO-3 leaf modules by default (`leaf_module.classes`).
DEFAULT_LEAF_MODULE_CLASSES = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)


class LeafModuleConfig(ConfigModel):
    """`zero_optimization.leaf_module`: modules ZeRO-3 gathers whole on entry (`ds_zero.set_z3_leaf_modules`).

    Each field takes a list or a single string; duplicates are dropped. Entries that match no module of
    the model are not an error.
    """

    classes: list[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_CLASSES))
    """Class names, bare (`"MixtralSparseMoeBlock"`) or qualified with their module."""
    names: list[str] = Field(default_factory=list)
    """Module names as in `model.named_modules()` (`"model.layers.0.mlp"`)."""
    name_suffixes: list[str] = Field(default_factory=list)
    """Suffixes of `named_modules()` names (`"mlp"` flags every `*.mlp`)."""

    @model_validator(mode="before")
    @classmethod
    def _lists(cls, data: Any) -> Any:
        """A single string means a list of one; duplicates go (first occurrence kept)."""
        if data is None:
            return {}
        if not isinstance(data, dict):
            raise TypeError(f"leaf_module must be a mapping of classes/names/name_suffixes, got {type(data).__name__}")
        out = {}
        for key, value in data.items():
            if isinstance(value, str):
                value = [value]
            if isinstance(value, (list, tuple)):
                value = list(dict.fromkeys(value))
            out[key] = value
        return out


class ZeroConfig(ConfigModel):
    """The `zero_optimization` section: which ZeRO stage, and how it buckets, overlaps and offloads.

    Keys, defaults and legacy spellings follow DeepSpeed 0.19.8. Sizes are in elements, not bytes;
    `5e8` is accepted for integer sizes. Of ZeRO++, hpZ (`zero_hpz_partition_size`) is implemented; the
    other ZeRO++ and the MiCS keys are accepted only at their defaults; the `zenflow` section is parsed
    (`ZenFlowConfig`) and run by `ZenFlowZeroOptimizer` / `ZenFlowZeroOptimizer_Stage3` (the plain ZeRO
    optimizers refuse an enabled one).
    """

    deprecated_keys: ClassVar[dict[str, str]] = {
        "stage3_gather_fp16_weights_on_model_save": "gather_16bit_weights_on_model_save",
    }
    inert_keys: ClassVar[dict[str, str]] = {
        "zero_quantized_weights": "ZeRO++ quantized weights are not implemented",
        "zero_quantized_nontrainable_weights": "quantized frozen weights are not implemented",
        "zero_quantized_gradients": "ZeRO++ quantized gradients are not implemented",
        "mics_shard_size": "MiCS is not implemented",
        "mics_hierarchical_params_gather": "MiCS is not implemented",
        "zeropp_loco_param": "ZeRO++ LoCo is not implemented",
        "legacy_stage1": "the deprecated ZeRO stage 1 is not supported",
    }
    ignored_keys: ClassVar[dict[str, str]] = {
        "contiguous_gradients": "gradient partitions are always contiguous buffers",
        "use_multi_rank_bucket_allreduce": "buckets are reduced with reduce-scatter or one all-reduce each",
        "round_robin_gradients": "each rank copies only its own contiguous gradient partition",
        "parameter_alignment": "flat buffers are padded to the data-parallel size only",
        "pipeline_loading_checkpoint": "stage-3 checkpoints load partition by partition",
        "enable_sanity_checks": "no extra invariant checks are implemented",
        "use_all_reduce_for_fetch_params": "parameters are always fetched with all-gather",
        "allgather_sequential": "parameters are always fetched in coalesced buckets",
        "elastic_checkpoint": "elastic checkpointing is deprecated; ds checkpoints always re-partition on load",
    }

    stage: int = Field(0, ge=0, le=3)
    """0 off, 1 partition optimizer state, 2 + gradients, 3 + parameters."""
    contiguous_gradients: bool = True
    """Copy reduced gradients into one contiguous buffer (avoids fragmentation)."""
    reduce_scatter: bool = True
    """Reduce gradients with reduce-scatter rather than all-reduce."""
    reduce_bucket_size: int = Field(500_000_000, gt=0)
    """Elements reduced at once."""
    use_multi_rank_bucket_allreduce: bool = True
    """All-reduce combined buckets."""
    allgather_partitions: bool = True
    """All-gather updated partitions after the step (else broadcast from each owner)."""
    allgather_bucket_size: int = Field(500_000_000, ge=0)
    """Elements all-gathered at once after the step."""
    overlap_comm: bool = False
    """Reduce gradients while backward goes on (absent or null: true at stage 3, false otherwise). Stages 1/2:
    buckets are reduced asynchronously, several in flight; stage 3: one bucket's reduce-scatter stays in flight
    while the next fills. False waits for each reduction as it is issued (less staging memory, no overlap)."""
    compute_grad_norm: bool = True
    """Compute the global gradient norm at each step (stage 1/2 may turn it off when not clipping)."""
    load_from_fp32_weights: bool = True
    """On load, restore master weights from the checkpoint's fp32 partitions."""
    elastic_checkpoint: bool = False
    """Legacy flag; checkpoints here always re-partition on load."""
    offload_param: OffloadParamConfig | None = None
    """Stage 3 parameter offload, as given; None (absent or null): off. Read it via `offload_param_or_default`."""
    offload_optimizer: OffloadOptimizerConfig | None = None
    """Optimizer state offload (stages 1-3), as given; None (absent or null): off. Read it via
    `offload_optimizer_or_default`."""
    sub_group_size: int = Field(1_000_000_000, ge=0)
    """Elements per optimizer-step tile in stage 3 (bounds the step's peak memory)."""
    prefetch_bucket_size: int = Field(50_000_000, ge=0, alias="stage3_prefetch_bucket_size")
    """Stage 3: elements prefetched ahead of use."""
    param_persistence_threshold: int = Field(100_000, ge=0, alias="stage3_param_persistence_threshold")
    """Stage 3: parameters with fewer elements stay whole on every rank."""
    model_persistence_threshold: int = Field(2**63 - 1, ge=0, alias="stage3_model_persistence_threshold")
    """Stage 3: cap on the total elements kept whole."""
    max_live_parameters: int = Field(1_000_000_000, ge=0, alias="stage3_max_live_parameters")
    """Stage 3: maximum gathered elements resident at once."""
    max_reuse_distance: int = Field(1_000_000_000, ge=0, alias="stage3_max_reuse_distance")
    """Stage 3: keep a gathered parameter if it is used again within this many elements of fetches."""
    gather_16bit_weights_on_model_save: bool = Field(False, alias="stage3_gather_16bit_weights_on_model_save")
    """Stage 3: `save_16bit_model()` gathers full weights into one file."""
    ignore_unused_parameters: bool = True
    """Stage 2: parameters without gradients are not an error."""
    round_robin_gradients: bool = False
    """Stage 1/2 with offload: spread gradient copies across ranks' buffers."""
    parameter_alignment: bool = False
    """Pad flat buffers for 16-byte alignment."""
    memory_efficient_linear: bool = True
    """Stage 3: make `torch.nn.functional.linear` DeepSpeed's `zero3_linear_wrap` for the rest of the process
    (installed by an entered `Init`, `Init(module=...)` and the stage-3 parameter manager; same values and
    gradients, ds re-gathers saved weights for backward whatever the op). Needed by
    `weight_quantization.quantized_initialization`, whose dequantizing wrappers go over it."""
    pipeline_loading_checkpoint: bool = False
    """Stage 3: pipelined checkpoint loading."""
    override_module_apply: bool = True
    """Stage 3: `nn.Module.apply` sees gathered parameters."""
    log_trace_cache_warnings: bool = False
    """Stage 3: warn when the recorded execution order is invalidated."""
    enable_sanity_checks: bool = False
    """Extra invariant checks (slow)."""
    leaf_module: LeafModuleConfig = Field(default_factory=LeafModuleConfig)
    """Stage 3: modules gathered whole on entry (mixture-of-experts blocks); see `LeafModuleConfig`."""

    zero_hpz_partition_size: int = Field(1, ge=1)
    """ZeRO++ hpZ (stage 3): ranks per block holding a secondary partition that backward gathers read
    inside the block (1: off). Must divide the data-parallel world size."""
    zero_quantized_weights: bool = False
    zero_quantized_nontrainable_weights: bool = False
    zero_quantized_gradients: bool = False
    mics_shard_size: int = -1
    mics_hierarchical_params_gather: bool = False
    zeropp_loco_param: dict[str, Any] | None = None
    zenflow: ZenFlowConfig | None = None
    """ZenFlow's importance-aware offload (`ZenFlowConfig`); present = on. Run by the ZenFlow optimizers only."""
    legacy_stage1: bool = False
    module_granularity_threshold: int = Field(0, alias="stage3_module_granularity_threshold")
    """Stage 3: modules of at most this many parameter elements per layer become leaf modules (0: off)."""
    use_all_reduce_for_fetch_params: bool = Field(False, alias="stage3_use_all_reduce_for_fetch_params")
    allgather_sequential: bool = Field(False, alias="stage3_allgather_sequential")
    save_muon_momentum_buffer_in_memory: bool = False
    """Stage 3 with Muon: keep the Muon momentum in memory rather than swapped with the optimizer state. ds always
    keeps it in memory (NVMe optimizer offload is refused with Muon), so both values train the same."""

    @classmethod
    def valid_keys(cls) -> list[str]:
        return [*super().valid_keys(), "cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory"]

    @model_validator(mode="before")
    @classmethod
    def _legacy_forms(cls, data: Any) -> Any:
        """Map the deprecated `cpu_offload*` switches, refuse a key given in both spellings, default overlap."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for short, long in _STAGE3_ALIASES.items():
            if short in data and long in data:
                raise ValueError(f"set either {short!r} or {long!r}, not both (they are the same setting)")
        legacy = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}
        for old, new in legacy.items():
            if old in data:
                value = data.pop(old)
                warnings.warn(
                    f'config key {old!r} is deprecated; use {new!r}: {{"device": "cpu"}}',
                    ConfigDeprecationWarning,
                    stacklevel=2,
                )
                if value:
                    if new in data:
                        raise ValueError(f"both {old!r} (deprecated) and {new!r} are set; keep only {new!r}")
                    data[new] = {"device": "cpu"}
        if "cpu_offload_use_pin_memory" in data:
            data.pop("cpu_offload_use_pin_memory")
            warnings.warn(
                "config key 'cpu_offload_use_pin_memory' is deprecated and ignored; use "
                "offload_optimizer.pin_memory / offload_param.pin_memory",
                ConfigDeprecationWarning,
                stacklevel=2,
            )
        if data.get("overlap_comm") is None:
            data["overlap_comm"] = data.get("stage") in (3, "3")
        return data

    @model_validator(mode="after")
    def _cross_checks(self) -> ZeroConfig:
        off = self.offload_optimizer_or_default
        if off.super_offload:
            if self.stage != 3:
                raise ValueError(
                    "zero_optimization.offload_optimizer.super_offload=true needs zero_optimization.stage=3 "
                    f"(SuperOffload is a stage-3 optimizer), but stage is {self.stage}"
                )
            if off.device != "cpu":
                raise ValueError(
                    "zero_optimization.offload_optimizer.super_offload=true needs "
                    f'zero_optimization.offload_optimizer.device="cpu", got {off.device!r}'
                )
            if not 0.0 < off.cpuadam_cores_perc <= 1.0:
                raise ValueError(
                    "zero_optimization.offload_optimizer.cpuadam_cores_perc must be in (0, 1] with super_offload "
                    f"(the CPU optimizer's share of the cores), got {off.cpuadam_cores_perc}"
                )
        elif off.cpuadam_cores_perc != type(off).model_fields["cpuadam_cores_perc"].default:
            warnings.warn(
                f"zero_optimization.offload_optimizer.cpuadam_cores_perc={off.cpuadam_cores_perc} has no effect "
                "without offload_optimizer.super_offload=true",
                UserWarning,
                stacklevel=2,
            )
        if off.ratio < 1.0 and self.stage != 3:
            raise ValueError(
                f"zero_optimization.offload_optimizer.ratio={off.ratio} (partial offload) needs "
                f"stage 3, but stage is {self.stage}"
            )
        if off.ratio < 1.0 and off.device == "nvme":
            raise ValueError(
                f"zero_optimization.offload_optimizer.ratio={off.ratio} (partial offload) is not supported with "
                'device "nvme" in ds; use device "cpu" or ratio 1'
            )
        if off.ratio < 1.0 and off.device == "none":
            warnings.warn(
                f"zero_optimization.offload_optimizer.ratio={off.ratio} has no effect without "
                'offload_optimizer.device "cpu"',
                UserWarning,
                stacklevel=2,
            )
        if self.offload_param_device != "none" and self.stage != 3:
            warnings.warn(
                f"zero_optimization.offload_param has no effect at stage {self.stage}: only stage 3 "
                "partitions parameters",
                UserWarning,
                stacklevel=2,
            )
        if self.offload_optimizer_or_default.device != "none" and self.stage == 0:
            # Nothing at stage 0 offloads (`offload_optimizer_device` is "none" there): `zero.Init` reads such a
            # config without using the section. The engine refuses it (ds-engine's `resolve_zero`), as
            # DeepSpeed's engine builds a CPU optimizer for it that fails at the first step on an accelerator.
            warnings.warn(
                "zero_optimization.offload_optimizer has no effect at stage 0: only ZeRO stages 1, 2 and 3 "
                "offload the optimizer state",
                UserWarning,
                stacklevel=2,
            )
        if self.elastic_checkpoint and self.stage == 3:
            _DEEPSPEED_LOGGER.warning(
                "ZeRO-3 elastic checkpointing is deprecated and no longer supported: zero_optimization."
                "elastic_checkpoint=True has no effect (ds checkpoints re-partition on load; use universal "
                "checkpointing to change the parallel layout)"
            )
        if not self.compute_grad_norm and self.stage == 3:
            raise ValueError("compute_grad_norm=False is only allowed for stages 1 and 2")
        return self

    # [Note: absent offload sections] DeepSpeed keeps an absent (or null) `offload_param` /
    # `offload_optimizer` as None, and code written for it tests `zero_config.offload_param is not None`,
    # so the fields hold the section exactly as given. The mechanism instead reads the section through
    # the `*_or_default` properties: an absent section then behaves exactly as `{"device": "none"}`
    # (every other setting at its default), and no reader needs its own None check.

    @property
    def offload_param_or_default(self) -> OffloadParamConfig:
        """The `offload_param` section as given, or the all-defaults one (device "none") when absent."""
        return self.offload_param if self.offload_param is not None else _NO_PARAM_OFFLOAD

    @property
    def offload_optimizer_or_default(self) -> OffloadOptimizerConfig:
        """The `offload_optimizer` section as given, or the all-defaults one (device "none") when absent."""
        return self.offload_optimizer if self.offload_optimizer is not None else _NO_OPTIMIZER_OFFLOAD

    @property
    def offload_optimizer_device(self) -> OffloadDevice:
        """Where the optimizer state lives: `offload_optimizer.device`, but "none" at stage 0 (no effect there)
        and when the section is absent."""
        return self.offload_optimizer_or_default.device if self.stage > 0 else "none"

    @property
    def offload_param_device(self) -> OffloadDevice:
        """Where stage-3 parameter partitions live: `offload_param.device`; "none" when the section is absent."""
        return self.offload_param_or_default.device
