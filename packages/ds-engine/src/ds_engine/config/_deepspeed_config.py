"""`DeepSpeedConfig`: a ds_config read, validated and resolved once, with "auto" placeholders tracked."""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import ds_comm
from ds_comm import ConfigError, validate_section
from ds_engine._data.section import get_data_efficiency_config
from ds_engine.config._batch import GAS, MBS, TBS, BatchPlan, resolve_batch
from ds_engine.config._checks import (
    check_cross_fields,
    check_sum_allreduce_conflicts,
    precision_name,
    warn_keys_without_effect,
)
from ds_engine.config._errors import DeepSpeedConfigError
from ds_engine.config._load import fill_auto, find_auto_paths, load_raw, without_paths
from ds_engine.config._pipe_sections import validate_pipe_section
from ds_engine.config._toplevel import DeepSpeedConfigModel
from ds_engine.config._weight_quant_section import resolve_weight_quantization
from ds_engine.config._zero_section import ZeroSettings, resolve_zero

__all__ = ["DeepSpeedConfig", "validate_model"]


class _DataParallelMpu(Protocol):
    def get_data_parallel_world_size(self) -> int: ...


def validate_model(data: dict[str, Any]) -> DeepSpeedConfigModel:
    """`data` as the top-level model; a bad value is a `DeepSpeedConfigError` starting with its key path."""
    try:
        return validate_section(DeepSpeedConfigModel, data)
    except ConfigError as err:
        raise DeepSpeedConfigError(str(err).replace("Value error, ", "")) from None


def _world_size(world_size: int | None, mpu: _DataParallelMpu | None) -> tuple[int, str]:
    if world_size is not None:
        return int(world_size), "given"
    if mpu is not None:
        return int(mpu.get_data_parallel_world_size()), "mpu.get_data_parallel_world_size()"
    if ds_comm.is_initialized():
        return ds_comm.get_world_size(), "torch.distributed world size"
    return 1, "default (torch.distributed not initialized)"


class DeepSpeedConfig:
    """A ds_config, validated: section models, the resolved batch triple, ZeRO settings.

    Construction reads the config (dict, JSON/hjson path, or base64 JSON), validates every section
    (unknown keys are errors with a suggestion), resolves the batch triple for the data-parallel
    world size and runs the cross-field checks. Nothing is built and nothing on a device is touched.

    "auto" placeholders (as HF Trainer configs use) are allowed here: they sit out validation,
    are listed in `auto_keys`, and can be filled with `auto_values=` or `fill_auto()`. `initialize()`
    refuses a config that still has any (`check_resolved()`).

    Args:
        config: a dict, a path to a JSON/hjson file, or urlsafe-base64 JSON.
        mpu: an object with `get_data_parallel_world_size()` (model-parallel setups).
        world_size: the data-parallel world size; default: the mpu's, else torch.distributed's, else 1.
        auto_values: dotted key path -> value for "auto" placeholders
            (`{"train_micro_batch_size_per_gpu": 8, "optimizer.params.lr": 3e-4}`).

    Raises:
        DeepSpeedConfigError: anything wrong, the message starting with the key path.
    """

    def __init__(
        self,
        config: str | os.PathLike[str] | Mapping[str, Any],
        mpu: _DataParallelMpu | None = None,
        *,
        world_size: int | None = None,
        auto_values: Mapping[str, Any] | None = None,
    ) -> None:
        self.source = str(config) if isinstance(config, (str, os.PathLike)) and os.path.isfile(config) else "<dict>"
        raw = load_raw(config)
        if auto_values:
            raw = fill_auto(raw, auto_values)
        self._raw = raw
        self.auto_keys: tuple[str, ...] = tuple(find_auto_paths(raw))
        check_sum_allreduce_conflicts(raw)
        #: The whole config as validated (`DeepSpeedConfigModel`, pydantic): `config.parsed.fp16.enabled`.
        self.parsed: DeepSpeedConfigModel = validate_model(without_paths(raw, list(self.auto_keys)))
        self.zero: ZeroSettings = resolve_zero(self.parsed.zero_optimization)
        self._weight_quantization = resolve_weight_quantization(self.parsed.weight_quantization)
        self._pipe_sections = {
            name: validate_pipe_section(name, getattr(self.parsed, name))
            for name in ("pipeline", "activation_checkpointing")
        }
        self.world_size, self.world_size_source = _world_size(world_size, mpu)
        m = self.parsed
        self.batch: BatchPlan | None = None
        if not {TBS, MBS, GAS} & set(self.auto_keys):
            self.batch = resolve_batch(
                m.train_batch_size, m.train_micro_batch_size_per_gpu, m.gradient_accumulation_steps, self.world_size
            )
        check_cross_fields(m, self.zero)
        warn_keys_without_effect(m)
        if self.zero.unavailable is not None:
            raise DeepSpeedConfigError(self.zero.unavailable)

    # -- "auto" -------------------------------------------------------------------------------------------
    def fill_auto(self, values: Mapping[str, Any]) -> DeepSpeedConfig:
        """A new config with the "auto" placeholders at the given dotted paths replaced (re-validated)."""
        return DeepSpeedConfig(self._raw, world_size=self.world_size, auto_values=values)

    def with_world_size(self, world_size: int) -> DeepSpeedConfig:
        """The same config resolved for another data-parallel world size."""
        if world_size == self.world_size:
            return self
        return DeepSpeedConfig(self._raw, world_size=world_size)

    def with_tensor_parallel_size(self, autotp_size: int) -> DeepSpeedConfig:
        """The same config with `tensor_parallel.autotp_size` set (what `tp_model_init` recorded)."""
        section = dict(self._raw.get("tensor_parallel") or {})
        section["autotp_size"] = autotp_size
        return DeepSpeedConfig({**self._raw, "tensor_parallel": section}, world_size=self.world_size)

    def with_sequence_parallel_size(self, size: int) -> DeepSpeedConfig:
        """The same config with `sequence_parallel_size` taken from the client's mpu (`initialize()` does this
        when the key is unset, as DeepSpeed reads the degree from the mpu); `raw` is unchanged."""
        if self.parsed.sequence_parallel_size == size:
            return self
        out = copy.copy(self)
        out.parsed = self.parsed.model_copy(update={"sequence_parallel_size": size})
        return out

    def with_checkpoint_layout(self, layout: str) -> DeepSpeedConfig:
        """The same config with `checkpoint.layout` decided (`initialize()` resolves an unset one); `raw`,
        which checkpoints store as the user wrote it, is unchanged."""
        if self.parsed.checkpoint.layout == layout:
            return self
        out = copy.copy(self)
        checkpoint = self.parsed.checkpoint.model_copy(update={"layout": layout})
        out.parsed = self.parsed.model_copy(update={"checkpoint": checkpoint})
        return out

    def check_resolved(self) -> None:
        """Raise unless every "auto" placeholder has been filled (initialize() calls this).

        Raises:
            DeepSpeedConfigError: listing the unfilled keys.
        """
        if self.auto_keys:
            keys = ", ".join(self.auto_keys)
            raise DeepSpeedConfigError(
                f'{keys}: still "auto"; a caller must fill these before initialize() '
                "(DeepSpeedConfig(config, auto_values={...}) or config.fill_auto({...}), as the HF Trainer "
                "integration does), or write the values into the config"
            )

    # -- the resolved values, DeepSpeed's attribute names ------------------------------------------------
    def _batch(self) -> BatchPlan:
        if self.batch is None and self._declared_batch is not None:
            self._configure_train_batch_size()
        if self.batch is None:
            self.check_resolved()
        assert self.batch is not None
        return self.batch

    # DeepSpeed code (and its tests) assigns the batch fields and then re-derives the triple.
    _declared_batch: dict[str, int | None] | None = None

    def _declare_batch(self, key: str, value: int | None) -> None:
        if self._declared_batch is None:
            self._declared_batch = self._given_batch()
        self._declared_batch[key] = None if value is None else int(value)
        self.batch = None  # stale until _configure_train_batch_size() resolves the new triple

    def _given_batch(self) -> dict[str, int | None]:
        m = self.parsed
        return {TBS: m.train_batch_size, MBS: m.train_micro_batch_size_per_gpu, GAS: m.gradient_accumulation_steps}

    def _batch_value(self, key: str) -> int | None:
        if self.batch is None and self._declared_batch is not None:
            return self._declared_batch[key]  # assigned, not yet resolved: what was assigned (None: unset)
        return int(getattr(self._batch(), key))

    def _configure_train_batch_size(self) -> None:
        """Resolve the batch triple from the values assigned to `train_batch_size`,
        `train_micro_batch_size_per_gpu` and `gradient_accumulation_steps` (None: not given), with DeepSpeed's
        rules (`ds_engine.config._batch.resolve_batch`).

        Raises:
            DeepSpeedConfigError: the values do not make a batch for this world size (also an
                AssertionError, which DeepSpeed raises here); the assigned values stay unresolved.
        """
        declared = self._declared_batch if self._declared_batch is not None else self._given_batch()
        self.batch = resolve_batch(declared[TBS], declared[MBS], declared[GAS], self.world_size)
        self._declared_batch = None

    @property
    def raw(self) -> dict[str, Any]:
        """The config as the user wrote it (after filling "auto"), a copy."""
        return copy.deepcopy(self._raw)

    @property
    def train_batch_size(self) -> int | None:
        """The resolved value; after an assignment, the assigned one until `_configure_train_batch_size()`."""
        return self._batch_value(TBS)

    @train_batch_size.setter
    def train_batch_size(self, value: int | None) -> None:
        self._declare_batch(TBS, value)

    @property
    def train_micro_batch_size_per_gpu(self) -> int | None:
        return self._batch_value(MBS)

    @train_micro_batch_size_per_gpu.setter
    def train_micro_batch_size_per_gpu(self, value: int | None) -> None:
        self._declare_batch(MBS, value)

    @property
    def gradient_accumulation_steps(self) -> int | None:
        return self._batch_value(GAS)

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value: int | None) -> None:
        self._declare_batch(GAS, value)

    @property
    def precision(self) -> str:
        """ "fp32", "fp16" or "bf16"."""
        return precision_name(self.parsed)

    @property
    def fp16_enabled(self) -> bool:
        return self.parsed.fp16.enabled

    @property
    def bfloat16_enabled(self) -> bool:
        return self.parsed.bf16.enabled

    @property
    def zero_optimization_stage(self) -> int:
        return self.zero.stage

    @property
    def zero_enabled(self) -> bool:
        return self.zero.stage > 0

    @property
    def zero_config(self) -> Any:
        """ds-zero's `ZeroConfig`, or None when ds-zero is not installed."""
        return self.zero.zero_config

    @property
    def expert_parallel_config(self) -> Any:
        """The `expert_parallel` section (`ExpertParallelConfig`) under DeepSpeed's attribute name."""
        return self.parsed.expert_parallel

    @property
    def weight_quantization_config(self) -> Any:
        """ds-zero's `WeightQuantizationConfig` of the `weight_quantization` section, or None when absent."""
        return self._weight_quantization

    @property
    def pipeline(self) -> Any:
        """`ds_pipe.PipelineConfig` for the `pipeline` section (its defaults when absent; needs ds-pipe)."""
        return self._pipe_section("pipeline")

    @property
    def activation_checkpointing(self) -> Any:
        """`ds_pipe.ActivationCheckpointingConfig` for that section (defaults when absent; needs ds-pipe)."""
        return self._pipe_section("activation_checkpointing")

    def _pipe_section(self, name: str) -> Any:
        section = self._pipe_sections[name]
        return section if section is not None else validate_pipe_section(name, {})

    @property
    def hybrid_engine(self) -> Any:
        """The `hybrid_engine` section (`HybridEngineConfig`, its defaults when absent)."""
        return self.parsed.hybrid_engine

    @property
    def monitor_config(self) -> Any:
        """`deepspeed.monitor.config.DeepSpeedMonitorConfig` of the four monitor sections (DeepSpeed's attribute)."""
        from ds_engine.config._monitor_section import DeepSpeedMonitorConfig

        m = self.parsed
        return DeepSpeedMonitorConfig(
            tensorboard=m.tensorboard, comet=m.comet, wandb=m.wandb, csv_monitor=m.csv_monitor
        )

    @property
    def optimizer_name(self) -> str | None:
        return self.parsed.optimizer.type if self.parsed.optimizer else None

    @property
    def optimizer_params(self) -> dict[str, Any] | None:
        return dict(self.parsed.optimizer.params) if self.parsed.optimizer else None

    @property
    def scheduler_name(self) -> str | None:
        return self.parsed.scheduler.type if self.parsed.scheduler else None

    @property
    def scheduler_params(self) -> dict[str, Any] | None:
        return dict(self.parsed.scheduler.params) if self.parsed.scheduler else None

    # DeepSpeed's flat names for the `data_types` and `torch_autocast` keys (raw names, as DeepSpeed keeps them).
    @property
    def grad_accum_dtype(self) -> str | None:
        return self.parsed.data_types.grad_accum_dtype

    @property
    def param_dtype(self) -> str | None:
        return self.parsed.data_types.param_dtype

    @property
    def buffer_dtype(self) -> str | None:
        return self.parsed.data_types.buffer_dtype

    @property
    def torch_autocast_enabled(self) -> bool:
        return self.parsed.torch_autocast.enabled

    @property
    def torch_autocast_dtype(self) -> str | None:
        return self.parsed.torch_autocast.dtype

    @property
    def torch_autocast_lower_precision_safe_modules(self) -> list[str] | None:
        return self.parsed.torch_autocast.lower_precision_safe_modules

    @property
    def data_efficiency_enabled(self) -> bool:
        return self.parsed.data_efficiency.enabled

    @property
    def data_efficiency_config(self) -> dict[str, Any]:
        """The `data_efficiency` section as DeepSpeed's dict (DeepSpeed's readers, defaults filled): what
        `DeepSpeedDataSampler`, the dynamic-batching helpers and `engine.data_efficiency_config()` read."""
        return get_data_efficiency_config(self._raw)

    def __getattr__(self, name: str) -> Any:
        # Sections and scalar keys by their ds_config name: config.fp16.loss_scale_window, config.gradient_clipping.
        if name.startswith("_") or name == "parsed":
            raise AttributeError(name)
        try:
            return getattr(self.parsed, name)
        except AttributeError:
            raise AttributeError(f"DeepSpeedConfig has no attribute or config key {name!r}") from None

    def iter_given_paths(self) -> Iterator[str]:
        """Dotted paths of every leaf the user wrote (for telling given values from defaults)."""
        yield from _leaf_paths(self._raw)

    def __repr__(self) -> str:
        return f"DeepSpeedConfig(source={self.source!r}, world_size={self.world_size}, auto_keys={self.auto_keys})"


def _leaf_paths(node: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    for key, value in node.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            yield from _leaf_paths(value, path)
        else:
            yield path
