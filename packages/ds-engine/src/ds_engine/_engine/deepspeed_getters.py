"""More of DeepSpeedEngine's read-only surface: the `zero_*` and precision getters, and the attributes libraries read.

DeepSpeed's engine answers every config key through a getter (`engine.zero_reduce_bucket_size()`);
clients (Hugging Face, Accelerate, Lightning, Megatron-DeepSpeed, RLHF trainers) call a few dozen of
them and read plain attributes (`engine.mpu`, `engine.client_optimizer`, `engine.data_parallel_group`).
Here they answer from the validated config and from what `initialize()` was given, resolved once; no
getter is on the step path. Features ds does not implement answer as DeepSpeed does when they are off.
"""

from __future__ import annotations

import dataclasses
import gc
import os
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

import ds_comm
from ds_engine._checkpoint.decoupled_checkpoint_engine import DecoupledCheckpointEngine
from ds_engine._checkpoint.fast_checkpoint_engine import FastCheckpointEngine
from ds_engine._checkpoint.torch_checkpoint_engine import TorchCheckpointEngine
from ds_engine._optional import require
from ds_engine._report.autotuning import DEFAULT_METRIC_FILE, DEFAULT_MODEL_INFO_FILE
from ds_engine.config._dtype_names import to_torch_dtype

if TYPE_CHECKING:
    from ds_engine._plan.dist_info import DistInfo
    from ds_engine._plan.plan import AssemblyPlan
    from ds_engine.config import DeepSpeedConfig, ZeroSettings

__all__ = ["ClientObjects", "DeepSpeedGetters"]


@dataclasses.dataclass(frozen=True)
class ClientObjects:
    """What the script passed to `initialize()`, kept as DeepSpeed keeps it (`engine.client_optimizer`, ...)."""

    mpu: Any = None
    optimizer: Any = None
    lr_scheduler: Any = None
    training_data: Any = None


_NO_CLIENT = ClientObjects()

#: `cpuadam_cores_perc()` with no `offload_optimizer` section: DeepSpeed 0.19.8's engine falls back to 0.9
#: there, while a given section defaults the key to 0.8.
_CPUADAM_CORES_PERC_WITHOUT_SECTION = 0.9


class DeepSpeedGetters:
    """Mixed into `DeepSpeedEngine`; complements `EngineQueries` (`_engine/queries.py`)."""

    _ds_config: DeepSpeedConfig
    _config: DeepSpeedConfig
    _plan: AssemblyPlan
    _dist: DistInfo
    _zero_settings: ZeroSettings
    _in_no_sync: bool
    _collate_fn: Any
    _stepper: Any
    _checkpointer: Any
    _client: ClientObjects = _NO_CLIENT
    module: nn.Module
    optimizer: Any

    has_moe_layers: bool = False
    """True when the model holds mixture-of-experts layers (ds-parallel's `MoE`; set by the engine)."""
    losses: Any = None
    """DeepSpeed's per-step loss slot, reset to None at every boundary (the plain engine never fills it)."""
    enable_backward_allreduce: bool = True
    """Gradients are reduced across data-parallel ranks (ds always does; DeepSpeed turns it off without a backend)."""

    # -- what initialize() was given ------------------------------------------------------------------
    @property
    def mpu(self) -> Any:
        """The model-parallel unit passed to (or built by, for sequence parallelism) `initialize()`."""
        return self._client.mpu

    @property
    def client_optimizer(self) -> Any:
        return self._client.optimizer

    @property
    def client_lr_scheduler(self) -> Any:
        return self._client.lr_scheduler

    @property
    def training_data(self) -> Any:
        return self._client.training_data

    @property
    def collate_fn(self) -> Any:
        return self._collate_fn

    @property
    def checkpoint_engine(self) -> TorchCheckpointEngine:
        """The engine scripts save their own files through (the config's serialization and writer, atomic writes):
        a `FastCheckpointEngine` sharing the engine's writer when `checkpoint.writer` is set (a
        `DecoupledCheckpointEngine` sharing its background worker with `writer.decoupled`)."""
        engine = self.__dict__.get("_checkpoint_engine")
        if engine is None:
            if self._checkpointer.decoupled is not None:
                engine = DecoupledCheckpointEngine(self._ds_config, writer=self._checkpointer.decoupled)
            elif self._ds_config.parsed.checkpoint.writer is not None:
                engine = FastCheckpointEngine(self._ds_config, file_writer=self._checkpointer.parts.file_writer)
            else:
                engine = TorchCheckpointEngine(self._ds_config)
            self.__dict__["_checkpoint_engine"] = engine
        return engine

    @property
    def param_names(self) -> dict[nn.Parameter, str]:
        """Each parameter of the module and its name (DeepSpeed's `{param: name}` map)."""
        return {p: n for n, p in self.module.named_parameters()}

    # -- process layout -------------------------------------------------------------------------------
    @property
    def data_parallel_group(self) -> Any:
        """The group gradients are reduced over (the world group when no mpu narrows it; None without a job)."""
        if self._dist.dp_group is not None:
            return self._dist.dp_group
        return torch.distributed.group.WORLD if ds_comm.is_initialized() else None

    @property
    def seq_data_parallel_group(self) -> Any:
        """Data x sequence-parallel ranks (the data-parallel group already spans them here)."""
        return self.data_parallel_group

    @property
    def sequence_parallel_size(self) -> int:
        return self._dist.sp_world_size

    @property
    def seq_parallel_group(self) -> Any:
        """The sequence-parallel group (the ranks sharing one sample's sequence), from the engine's mpu.

        As in DeepSpeed it exists only with `sequence_parallel_size` > 1 (`hasattr` is False otherwise, and a
        script that reduces over it cannot fall back to the world group unnoticed)."""
        if self._dist.sp_world_size <= 1:
            raise AttributeError(
                "engine.seq_parallel_group exists only with sequence_parallel_size > 1 (as in DeepSpeed); "
                "this engine runs sequence_parallel_size=1"
            )
        return self.mpu.get_sequence_parallel_group()

    def get_sequence_parallel_group(self) -> Any:
        """`seq_parallel_group` (DeepSpeed's getter; an AttributeError with `sequence_parallel_size` 1)."""
        return self.seq_parallel_group

    @property
    def dist_backend(self) -> str | None:
        """The torch.distributed backend of the job (None without one)."""
        return str(torch.distributed.get_backend()) if ds_comm.is_initialized() else None

    @property
    def inside_no_sync_ctxt(self) -> bool:
        """Whether a `with engine.no_sync():` block is running."""
        return self._in_no_sync

    @property
    def gradient_average(self) -> bool:
        """`gradient_allreduce_op` is "mean" (else gradients are summed)."""
        return self._ds_config.parsed.gradient_allreduce_op == "mean"

    # -- precision ------------------------------------------------------------------------------------
    def amp_enabled(self) -> bool:
        """Apex AMP: never (DeepSpeed 0.19 removed it; the `amp` key is refused)."""
        return False

    def fp16_auto_cast(self) -> bool:
        return self._ds_config.parsed.fp16.auto_cast

    def initial_dynamic_scale(self) -> float:
        return float(2.0**self._ds_config.parsed.fp16.initial_scale_power)

    def dynamic_loss_scale_args(self) -> dict[str, Any] | None:
        """The dynamic scaler's settings (DeepSpeed's key names), None unless fp16 scales dynamically."""
        fp16 = self._ds_config.parsed.fp16
        if not (fp16.enabled and fp16.dynamic_loss_scale):
            return None
        return {
            "init_scale": 2.0**fp16.initial_scale_power,
            "scale_window": fp16.loss_scale_window,
            "delayed_shift": fp16.hysteresis,
            "consecutive_hysteresis": fp16.consecutive_hysteresis,
            "min_scale": fp16.min_loss_scale,
        }

    @property
    def communication_data_type(self) -> torch.dtype:
        """The dtype gradients are reduced in: `communication_data_type`, else the training dtype."""
        named = self._ds_config.parsed.communication_data_type
        if named is not None:
            return to_torch_dtype(named)
        return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(self._plan.precision, torch.float32)

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """(parameter dtype, gradient accumulation dtype)."""
        return self._plan.dtype, self._plan.grad_accum_dtype

    def postscale_gradients(self) -> bool:
        return not self._ds_config.parsed.prescale_gradients

    def gradient_predivide_factor(self) -> float:
        return self._ds_config.parsed.gradient_predivide_factor

    def torch_autocast_enabled(self) -> bool:
        return self._ds_config.parsed.torch_autocast.enabled

    def torch_autocast_dtype(self) -> torch.dtype | None:
        """The forward's autocast dtype when enabled (the device default when the section names none); else
        the section's `dtype`, if any."""
        if self._plan.autocast_dtype is not None:
            return self._plan.autocast_dtype
        named = self._ds_config.parsed.torch_autocast.dtype
        return to_torch_dtype(named) if named is not None else None

    def torch_autocast_lower_precision_safe_modules(self) -> list[str] | None:
        return self._ds_config.parsed.torch_autocast.lower_precision_safe_modules

    def optimizer_legacy_fusion(self) -> bool:
        section = self._ds_config.parsed.optimizer
        return bool(section.legacy_fusion) if section is not None else False

    def bfloat16_master_weights_and_gradients(self) -> bool:
        return self._ds_config.parsed.bf16.bf16_master_weights_and_grads

    bf16_master_weights_and_gradients = bfloat16_master_weights_and_gradients

    def fp16_master_weights_and_gradients(self) -> bool:
        return self._ds_config.parsed.fp16.fp16_master_weights_and_grads

    def bf16_optimizer_states(self) -> bool:
        return self._ds_config.parsed.bf16.bf16_optimizer_states

    # -- run settings ---------------------------------------------------------------------------------
    def managed_gradient_accumulation(self) -> bool:
        return self._ds_config.parsed.managed_gradient_accumulation

    def dataloader_drop_last(self) -> bool:
        return self._ds_config.parsed.dataloader_drop_last

    def memory_breakdown(self) -> bool:
        return self._ds_config.parsed.memory_breakdown

    def dump_state(self) -> bool:
        return self._ds_config.parsed.dump_state

    def log_level(self) -> str | None:
        # `log_level` as written ("ERROR"), from `_config` as DeepSpeed reads it.
        return self._config.log_level

    def checkpoint_tag_validation_enabled(self) -> bool:
        return self._ds_config.parsed.checkpoint.tag_validation != "IGNORE"

    def checkpoint_tag_validation_fail(self) -> bool:
        return self._ds_config.parsed.checkpoint.tag_validation == "FAIL"

    def checkpoint_writer_enabled(self) -> bool:
        """Whether `checkpoint.writer` (FastPersist) writes the checkpoint files."""
        return self._ds_config.parsed.checkpoint.writer is not None

    def checkpoint_serialization_enabled(self) -> bool:
        return self._ds_config.parsed.checkpoint.checkpoint_serialization

    def use_node_local_storage(self) -> bool:
        return self._ds_config.parsed.checkpoint.use_node_local_storage

    def aio_config(self) -> Any:
        """The `aio` section (a `ds_ops.AioConfig`)."""
        return self._ds_config.parsed.aio

    def zero_allow_untested_optimizer(self) -> bool:
        return self._ds_config.parsed.zero_allow_untested_optimizer

    def zero_force_ds_cpu_optimizer(self) -> bool:
        return self._ds_config.parsed.zero_force_ds_cpu_optimizer

    def autotuning_enabled(self) -> bool:
        return self._ds_config.parsed.autotuning.enabled

    def autotuning_start_profile_step(self) -> int:
        return self._ds_config.parsed.autotuning.start_profile_step

    def autotuning_end_profile_step(self) -> int:
        return self._ds_config.parsed.autotuning.end_profile_step

    def autotuning_metric(self) -> str:
        return self._ds_config.parsed.autotuning.metric

    def autotuning_metric_path(self) -> str:
        """Where an experiment writes its metrics (`autotuning_metric.json` in the working directory by default)."""
        path = self._ds_config.parsed.autotuning.metric_path
        return path or os.path.join(os.getcwd(), DEFAULT_METRIC_FILE)

    def autotuning_model_info_path(self) -> str:
        """Where the model profile run writes (`autotuning_model_info.json` in the working directory by default)."""
        path = self._ds_config.parsed.autotuning.model_info_path
        return path or os.path.join(os.getcwd(), DEFAULT_MODEL_INFO_FILE)

    def autotuning_profile_model_info(self) -> bool:
        at = self._ds_config.parsed.autotuning
        return at.enabled and at.model_info is not None and at.model_info.profile

    def is_deepcompile_enabled(self) -> bool:
        """`compile.deepcompile` is on (it takes effect at `engine.compile()`)."""
        return bool(self._ds_config.parsed.compile.deepcompile)

    def is_deepcompile_active(self) -> bool:
        """DeepCompile's backend compiled the module and has not fallen back to the eager hooks (at stage 0,
        where DeepCompile is a plain torch.compile: the module was compiled)."""
        return getattr(self, "_dc_backend", None) is not None or (
            self.is_deepcompile_enabled()
            and getattr(self, "_is_compiled", False)
            and self.zero_optimization_stage() == 0
        )

    def collect_python_gc(self) -> int:
        """Run Python's cyclic garbage collector now, at a point the script chose; returns what it freed."""
        return gc.collect()

    flatten = staticmethod(_flatten_dense_tensors)
    """DeepSpeed's `engine.flatten`: torch's dense-tensor flattening."""
    unflatten = staticmethod(_unflatten_dense_tensors)

    @staticmethod
    def is_map_style_dataset(obj: Any) -> bool:
        return hasattr(obj, "__getitem__") and hasattr(obj, "__len__")

    @staticmethod
    def is_iterable_style_dataset(obj: Any) -> bool:
        return isinstance(obj, torch.utils.data.IterableDataset)

    # -- zero_optimization ----------------------------------------------------------------------------
    def _zero_config(self) -> Any:
        """The validated `zero_optimization` section (ds-zero's defaults where the config has none)."""
        if self._zero_settings.zero_config is not None:
            return self._zero_settings.zero_config
        return require("ds_zero", extra="zero", feature="the zero_optimization settings").ZeroConfig()

    def _get_zero_param_shapes(self) -> list[dict[str, torch.Size]]:
        """DeepSpeed's name -> shape of the ZeRO optimizer's trainable parameters, one dict per sub-group:
        stage 3's `sub_group_size` tiles (each its own base-optimizer parameter and state entry), or at
        stages 1 and 2 each param group's flat partition. Tests and conversion scripts use it to lay a
        gathered optimizer state out per parameter.

        Raises:
            RuntimeError: ZeRO is off (there are no partitions to describe).
        """
        if self._zero_settings.stage == 0 or self._stepper is None:
            raise RuntimeError(
                "_get_zero_param_shapes() describes ZeRO's optimizer partitions; this engine has "
                "zero_optimization.stage 0 or no optimizer"
            )
        ds_zero = require("ds_zero", extra="zero", feature="_get_zero_param_shapes")
        groups = ds_zero.zero_sub_group_param_shapes(self._stepper.optimizer, self.module)
        return [{name: torch.Size(shape) for name, shape in group.items()} for group in groups]

    def zero_reduce_bucket_size(self) -> int:
        return int(self._zero_config().reduce_bucket_size)

    def zero_reduce_scatter(self) -> bool:
        return bool(self._zero_config().reduce_scatter)

    def zero_overlap_comm(self) -> bool:
        return bool(self._zero_config().overlap_comm)

    def zero_contiguous_gradients(self) -> bool:
        return bool(self._zero_config().contiguous_gradients)

    def zero_allgather_partitions(self) -> bool:
        return bool(self._zero_config().allgather_partitions)

    def zero_allgather_bucket_size(self) -> int:
        return int(self._zero_config().allgather_bucket_size)

    def zero_multi_rank_bucket_allreduce(self) -> bool:
        return bool(self._zero_config().use_multi_rank_bucket_allreduce)

    def zero_compute_grad_norm(self) -> bool:
        return bool(self._zero_config().compute_grad_norm)

    def zero_load_from_fp32_weights(self) -> bool:
        return bool(self._zero_config().load_from_fp32_weights)

    def zero_elastic_checkpoint(self) -> bool:
        return bool(self._zero_config().elastic_checkpoint)

    def zero_sub_group_size(self) -> int:
        return int(self._zero_config().sub_group_size)

    def zero_prefetch_bucket_size(self) -> int:
        return int(self._zero_config().prefetch_bucket_size)

    def zero_param_persistence_threshold(self) -> int:
        return int(self._zero_config().param_persistence_threshold)

    def zero_model_persistence_threshold(self) -> int:
        return int(self._zero_config().model_persistence_threshold)

    def zero_max_live_parameters(self) -> int:
        return int(self._zero_config().max_live_parameters)

    def zero_max_reuse_distance(self) -> int:
        return int(self._zero_config().max_reuse_distance)

    def zero_module_granularity_threshold(self) -> int:
        return int(self._zero_config().module_granularity_threshold)

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return bool(self._zero_config().gather_16bit_weights_on_model_save)

    def zero_ignore_unused_parameters(self) -> bool:
        return bool(self._zero_config().ignore_unused_parameters)

    def zero_round_robin_gradients(self) -> bool:
        return bool(self._zero_config().round_robin_gradients)

    def zero_parameter_alignment(self) -> bool:
        return bool(self._zero_config().parameter_alignment)

    def zero_legacy_stage1(self) -> bool:
        return bool(self._zero_config().legacy_stage1)

    def zero_hpz_partition_size(self) -> int:
        return int(self._zero_config().zero_hpz_partition_size)

    def zero_quantized_weights(self) -> bool:
        return bool(self._zero_config().zero_quantized_weights)

    def zero_quantized_nontrainable_weights(self) -> bool:
        return bool(self._zero_config().zero_quantized_nontrainable_weights)

    def zero_quantized_gradients(self) -> bool:
        return bool(self._zero_config().zero_quantized_gradients)

    def zero_allgather_sequential(self) -> bool:
        return bool(self._zero_config().allgather_sequential)

    def zero_log_trace_cache_warnings(self) -> bool:
        return bool(self._zero_config().log_trace_cache_warnings)

    def zero_save_muon_momentum_buffer_in_memory(self) -> bool:
        return bool(self._zero_config().save_muon_momentum_buffer_in_memory)

    def is_sanity_checks_enabled(self) -> bool:
        return bool(self._zero_config().enable_sanity_checks)

    def zero_partial_offload(self) -> float:
        return float(self._zero_config().offload_optimizer_or_default.ratio)

    def zero_nvme_offload_optimizer(self) -> bool:
        return self._zero_settings.offload_optimizer_device == "nvme"

    def super_offload(self) -> bool:
        return bool(self._zero_config().offload_optimizer_or_default.super_offload)

    def cpuadam_cores_perc(self) -> float:
        """The section's `cpuadam_cores_perc` (0.8 by default); DeepSpeed's engine answers 0.9 without a section."""
        section = self._zero_config().offload_optimizer
        return _CPUADAM_CORES_PERC_WITHOUT_SECTION if section is None else float(section.cpuadam_cores_perc)

    def is_first_weights_partition_group(self) -> bool:
        return self._zero_settings.stage >= 3

    def zenflow_config(self) -> Any:
        return self._zero_config().zenflow
