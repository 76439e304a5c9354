"""Pydantic models of the ds_config sections ds-engine owns, with DeepSpeed's keys and defaults.

Sections owned elsewhere: `zero_optimization` (ds_zero.ZeroConfig), `comms_logger`
(ds_comm.CommsLoggerConfig), `aio` (ds_ops.AioConfig), `pipeline`/`activation_checkpointing`
(ds_pipe.PipelineConfig / ActivationCheckpointingConfig, see `_pipe_sections.py`).
"""

from __future__ import annotations

import warnings
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ds_comm import ConfigModel
from ds_engine._optim.optimizers import ParamError, canonical_optimizer_name, check_optimizer_params
from ds_engine._optim.schedulers import check_scheduler_params, scheduler_class
from ds_engine.config._types import DtypeName, Float, Int, NonNegFloat, NonNegInt, PosInt

__all__ = [
    "BF16Config",
    "CSVMonitorConfig",
    "CheckpointConfig",
    "CheckpointWriterConfig",
    "CometConfig",
    "DataTypesConfig",
    "FP16Config",
    "FlopsProfilerConfig",
    "OptimizerConfig",
    "ParallelWriteConfig",
    "SchedulerConfig",
    "TensorBoardConfig",
    "ThroughputTimerConfig",
    "TimersConfig",
    "TorchAutocastConfig",
    "WandbConfig",
]


def _a_number(value: Any) -> Any:
    # pydantic's own message for a list or dict ("valid number") does not say what the key wants.
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"must be a number, got {type(value).__name__} {value!r}")
    return value


class FP16Config(ConfigModel):
    """`fp16`: half-precision training with fp32 master weights and a (dynamic) loss scale."""

    enabled: bool = False
    """Cast parameters to fp16 and train with fp32 master weights."""
    auto_cast: bool = False
    """Cast floating-point inputs of `forward` to fp16."""
    loss_scale: Annotated[NonNegFloat, BeforeValidator(_a_number)] = 0.0
    """0 = dynamic loss scaling; > 0 = this static scale."""
    initial_scale_power: Int = 16
    """The dynamic scale starts at 2 ** initial_scale_power."""
    # The dynamic scaler's knobs are checked (> 0) only where they are used: fp16 on with loss_scale 0.
    # A static or disabled section may carry any integer there, as DeepSpeed accepts.
    loss_scale_window: Int = 1000
    """Clean steps (no inf/nan) before the dynamic scale doubles."""
    hysteresis: Int = 2
    """Overflows tolerated before the dynamic scale halves (delayed shift)."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis budget on every clean step, so only consecutive overflows lower the scale."""
    min_loss_scale: Float = 1.0
    """Floor of the dynamic scale; an overflow at the floor stops the run (it is diverging)."""
    fp16_master_weights_and_grads: bool = False
    """fp16 master weights and gradient partitions on the host, fp32 moments in DeepSpeedCPUAdam (ZeRO 1-3 with CPU
    optimizer offload, as in DeepSpeed; `ds_zero._master_dtype`)."""

    @model_validator(mode="after")
    def _dynamic_needs_positive(self) -> FP16Config:
        if self.enabled and self.loss_scale == 0:
            for key in ("loss_scale_window", "hysteresis", "min_loss_scale"):
                if getattr(self, key) <= 0:
                    raise ValueError(f"{key}={getattr(self, key)} must be > 0 with dynamic loss scaling (loss_scale=0)")
        return self

    @model_validator(mode="after")
    def _floor_below_the_start(self) -> FP16Config:
        """The dynamic scale starts at 2**initial_scale_power and only halves down to `min_loss_scale`: a floor
        above the start is a contradiction (the first overflow would raise the scale to the floor). With a
        static `loss_scale` the floor is not used, as in DeepSpeed, so it only warns there."""
        if not self.enabled or self.min_loss_scale <= 0:
            return self
        if self.loss_scale == 0 and self.min_loss_scale > 2.0**self.initial_scale_power:
            raise ValueError(
                f"min_loss_scale={self.min_loss_scale} is above the initial loss scale 2**initial_scale_power = "
                f"{2.0**self.initial_scale_power:g} (initial_scale_power={self.initial_scale_power}); the dynamic "
                "scale would start below its own floor: lower min_loss_scale or raise initial_scale_power"
            )
        if self.loss_scale > 0 and self.min_loss_scale > self.loss_scale:
            warnings.warn(
                f"fp16.min_loss_scale={self.min_loss_scale} is above the static fp16.loss_scale={self.loss_scale:g} "
                "and has no effect: it is the floor of dynamic loss scaling (loss_scale=0)",
                UserWarning,
                stacklevel=2,
            )
        return self

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.loss_scale == 0

    def dynamic_loss_args(self) -> dict[str, Any]:
        """Keyword arguments of `ds_ops.precision.DynamicLossScaler`."""
        return {
            "init_scale": 2.0**self.initial_scale_power,
            "scale_window": self.loss_scale_window,
            "delayed_shift": self.hysteresis,
            "consecutive_hysteresis": self.consecutive_hysteresis,
            "min_scale": self.min_loss_scale,
        }


class BF16Config(ConfigModel):
    """`bf16` (legacy key `bfloat16`): bf16 parameters with fp32 master weights and fp32 gradient accumulation,
    or, under ZeRO with `bf16_master_weights_and_grads`, bf16 masters and gradient partitions too."""

    enabled: bool = False
    """Cast parameters to bf16 and train with fp32 master weights."""
    check_grad_overflow: bool = True
    """Skip the step when a gradient holds inf/nan (no loss scale is involved)."""
    immediate_grad_update: bool = False
    """At ZeRO stage 0, move each bf16 gradient into the fp32 accumulation buffer as soon as backward produced
    it (freeing it then), rather than after the whole backward: less peak memory, the same sums."""
    bf16_master_weights_and_grads: bool = False
    """ZeRO stage 1-3: keep the master weights and the gradient partitions in bf16 (2 + 2 bytes per element
    of a rank's partition instead of 4 + 4). Without `bf16_optimizer_states` the moments stay fp32, which (as in
    DeepSpeed) needs `zero_optimization.offload_optimizer.device: "cpu"` with DeepSpeedCPUAdam; NVMe offload is
    not implemented with it."""
    bf16_optimizer_states: bool = False
    """ZeRO stage 1-3: the optimizer's moments in bf16 too (needs `bf16_master_weights_and_grads`); with CPU
    optimizer offload the configured Adam is built as `DeepSpeedCPUAdam(fp32_optimizer_states=False)`."""


def _param_error(err: ParamError) -> PydanticCustomError:
    # Reported as "<section>.params.<key>: ..." by ds_comm's error formatter.
    return PydanticCustomError("unsupported_key", "{message}", {"key": f"params.{err.key}", "message": str(err)})


def _type_name(value: Any) -> Any:
    if not isinstance(value, str):
        raise ValueError(f"type must be a string, got {type(value).__name__}")
    return value


class OptimizerConfig(ConfigModel):
    """`optimizer`: which optimizer initialize() builds when the script passes none."""

    ignored_keys: ClassVar[dict[str, str]] = {
        "legacy_fusion": "DeepSpeed reads it only in its fp16 ZeRO-0 fused-optimizer step, which ds refuses with it"
    }

    type: Annotated[str, BeforeValidator(_type_name)]
    """A DeepSpeed name (Adam, AdamW, Adagrad, Lamb, Lion; any case) or a torch.optim class (SGD, RMSprop, ...)."""
    params: dict[str, Any] = {}
    """Constructor keyword arguments; for Adam/AdamW also torch_adam, adam_w_mode, fp32_optimizer_states."""
    legacy_fusion: bool = False
    """DeepSpeed's legacy fused fp16 step (`FP16_Optimizer(fused_adam_legacy=True)`): read only with fp16 at ZeRO
    stage 0, where DeepSpeed 0.19.8 then passes gradients and a scale to a FusedAdam that no longer takes them
    and fails at the first step; ds refuses it there and warns that it has no effect elsewhere, as DeepSpeed
    ignores it there."""

    @field_validator("type")
    @classmethod
    def _known(cls, value: str) -> str:
        return canonical_optimizer_name(value)

    @model_validator(mode="after")
    def _params_fit(self) -> OptimizerConfig:
        try:
            check_optimizer_params(self.type, self.params)
        except ParamError as err:
            raise _param_error(err) from None
        return self


class SchedulerConfig(ConfigModel):
    """`scheduler`: the lr schedule initialize() builds when the script passes none."""

    type: Annotated[str, BeforeValidator(_type_name)]
    """WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest, or a torch.optim.lr_scheduler class."""
    params: dict[str, Any] = {}
    """Constructor keyword arguments (the optimizer is passed first)."""

    @field_validator("type")
    @classmethod
    def _known(cls, value: str) -> str:
        scheduler_class(value)
        return value

    @model_validator(mode="after")
    def _params_fit(self) -> SchedulerConfig:
        try:
            check_scheduler_params(self.type, self.params)
        except ParamError as err:
            raise _param_error(err) from None
        return self


def _upper(value: Any) -> Any:
    return value.upper() if isinstance(value, str) else value


class ParallelWriteConfig(ConfigModel):
    """`checkpoint.parallel_write`."""

    inert_keys: ClassVar[dict[str, str]] = {"pipeline_stage": "pipeline-stage parallel writes are not implemented"}

    pipeline_stage: bool = False
    """Spread pipeline layer files over data-parallel ranks; only false is accepted."""


#: The I/O alignment of the async I/O op (ds_ops.aio): the staging buffer is cut into multiples of it.
_IO_ALIGNMENT = 4096


class CheckpointWriterConfig(ConfigModel):
    """`checkpoint.writer`: how checkpoint files reach the disk (DeepSpeed's FastPersist).

    Every file still goes through ds's atomic publish (temporary name, fsync, rename): the writer only
    changes how the temporary file is written.
    """

    inert_keys: ClassVar[dict[str, str]] = {
        "io_multiplier": "more parallel writers than data-parallel ranks is not implemented",
    }

    type: Annotated[Literal["FAST", "PYTHON", "MOCK"], BeforeValidator(_upper)] = "FAST"
    """FAST: `torch.save` through aligned buffers and the async I/O op (the `aio` section's settings);
    PYTHON: through a plain Python file; MOCK (DeepSpeed's serialization-only timing) is refused: it writes
    no bytes, so the published checkpoint would be empty."""
    decoupled: bool = False
    """Write the files from a background worker: the save returns once the state is copied, and `latest`
    moves when every rank's files are durable (`ds_engine._checkpoint.decoupled`)."""
    io_buffer_double: bool = True
    """Split the buffer in two and fill one half while the other is written."""
    io_buffer_size: PosInt = 64 * 1024**2
    """Bytes of the staging buffer (a multiple of 4096, of 8192 when double-buffered)."""
    show_statistics: bool = False
    """Log each file's write statistics (bytes, seconds, GB/s) at INFO."""
    data_parallel: Annotated[Literal["REPLICA", "SOCKET", "MACHINE"] | None, BeforeValidator(_upper)] = None
    """Parallel writes of the model-states file: REPLICA, every data-parallel rank writes a share of it;
    None, data-parallel rank 0 writes it alone. SOCKET and MACHINE (one writer per socket / node) are refused."""
    io_multiplier: PosInt = 1
    """Writers per data-parallel rank; only 1 is accepted."""

    @field_validator("type")
    @classmethod
    def _no_mock(cls, value: str) -> str:
        if value == "MOCK":
            raise ValueError(
                "'MOCK' writes no bytes (it times serialization alone), so the published checkpoint would be "
                "empty; use 'FAST' or 'PYTHON' (ds_ops.fast_io.MockFileWriter serves timing outside the engine)"
            )
        return value

    @field_validator("data_parallel")
    @classmethod
    def _replica_only(cls, value: str | None) -> str | None:
        if value in ("SOCKET", "MACHINE"):
            raise ValueError(
                f"{value!r} (one writer per {value.lower()}) is not implemented; use 'REPLICA' (every "
                "data-parallel rank writes a share of the file) or null (rank 0 writes it)"
            )
        return value

    @model_validator(mode="after")
    def _decoupled_not_replica(self) -> CheckpointWriterConfig:
        if self.decoupled and self.data_parallel == "REPLICA":
            raise PydanticCustomError(
                "value_error",
                "decoupled=true with data_parallel='REPLICA' is not implemented (the ranks' shared write of one "
                "file is a collective, which a background write cannot be); drop one of them",
                {},
            )
        return self

    @model_validator(mode="after")
    def _replica_needs_fast(self) -> CheckpointWriterConfig:
        if self.data_parallel == "REPLICA" and self.type != "FAST":
            raise PydanticCustomError(
                "value_error",
                "data_parallel='REPLICA' needs type 'FAST' (ranks write stripes of one file through the async "
                "I/O op); got type {type}",
                {"type": repr(self.type)},
            )
        return self

    @field_validator("io_buffer_size")
    @classmethod
    def _buffer_fits(cls, value: int, info: ValidationInfo) -> int:
        double = info.data.get("io_buffer_double", True)
        unit = _IO_ALIGNMENT * (2 if double else 1)
        if value % unit:
            why = ", twice over with io_buffer_double" if double else ""
            raise ValueError(
                f"{value} must be a multiple of {unit} (the 4096-byte I/O alignment{why}); "
                f"e.g. {max(unit, value // unit * unit)}"
            )
        return value


class CheckpointConfig(ConfigModel):
    """`checkpoint`: how save_checkpoint/load_checkpoint behave."""

    inert_keys: ClassVar[dict[str, str]] = {
        "use_node_local_storage": "node-local checkpoint storage is not implemented",
    }

    tag_validation: Annotated[Literal["WARN", "IGNORE", "FAIL"], BeforeValidator(_upper)] = "WARN"
    """Check that every rank saves under the same tag: Warn, Ignore or Fail (case-insensitive)."""
    load_universal: bool = False
    """`load_checkpoint` reads a universal checkpoint (`ds_to_universal`'s output; the tag from
    `latest_universal`), at any world size and ZeRO stage 1-3."""
    use_node_local_storage: bool = False
    """Write per-node copies; only false is accepted."""
    parallel_write: ParallelWriteConfig = ParallelWriteConfig()
    """Parallel write options."""
    checkpoint_serialization: bool = True
    """torch.save's zipfile serialization (false: the legacy format)."""
    writer: CheckpointWriterConfig | None = None
    """How checkpoint files are written (FastPersist); null: `torch.save` to the file."""

    @model_validator(mode="after")
    def _replica_needs_zipfile(self) -> CheckpointConfig:
        if self.writer is not None and self.writer.data_parallel == "REPLICA" and not self.checkpoint_serialization:
            raise PydanticCustomError(
                "value_error",
                "writer.data_parallel='REPLICA' needs checkpoint_serialization true: ranks check they wrote the "
                "same file through the CRC-32s of torch's zip format, which the legacy format lacks",
                {},
            )
        return self

    layout: Literal["ds", "deepspeed"] | None = None
    """The files `save_checkpoint` writes (a ds key; DeepSpeed ignores it): "ds", ds's own layout (ZeRO
    partitions in ds-zero's format, loadable by ds at any world size and stage), or "deepspeed", the
    files DeepSpeed 0.19.8 writes (and loads at the saved world size), built from a staged ds save.
    ds loads both layouts. Unset: ds's layout, or DeepSpeed's once the `deepspeed` distribution is
    imported (`config._layout_default`) where that layout can hold the job; `initialize()` decides."""


class _MonitorConfig(ConfigModel):
    enabled: bool = False
    """Write events (rank 0 only)."""
    output_path: str = ""
    """Directory for the output (default: the current directory)."""
    job_name: str = "DeepSpeedJobName"
    """Subdirectory for this run."""


class TensorBoardConfig(_MonitorConfig):
    """`tensorboard`: scalars through torch.utils.tensorboard (needs the tensorboard package)."""


class CSVMonitorConfig(_MonitorConfig):
    """`csv_monitor`: one CSV file per event under output_path/job_name."""


class WandbConfig(ConfigModel):
    """`wandb`: Weights & Biases logging (needs the wandb package; mode and directory from WANDB_* variables)."""

    enabled: bool = False
    """Log events to a wandb run (rank 0 only)."""
    group: str | None = None
    """wandb group of the run."""
    team: str | None = None
    """wandb entity (team); None: the user's default."""
    project: str = "deepspeed"
    """wandb project."""


class CometConfig(ConfigModel):
    """`comet`: Comet logging (needs the comet_ml package); None values fall back to Comet's own configuration."""

    enabled: bool = False
    """Log events to a Comet experiment (rank 0 only)."""
    samples_log_interval: PosInt = 100
    """Log an event name again only after this many more samples."""
    project: str | None = None
    """Comet project."""
    workspace: str | None = None
    """Comet workspace."""
    api_key: str | None = None
    """Comet API key."""
    experiment_name: str | None = None
    """Name given to the experiment."""
    experiment_key: str | None = None
    """Key of the experiment to create or continue."""
    online: bool | None = None
    """False: write an offline archive instead of uploading."""
    mode: str | None = None
    """comet_ml.start's mode: "get", "create" or "get_or_create"."""


class DataTypesConfig(ConfigModel):
    """`data_types`: dtypes of gradient accumulation, parameters and buffers."""

    grad_accum_dtype: DtypeName | None = None
    """Gradient accumulation dtype; None: fp32 under bf16, the model dtype otherwise."""
    param_dtype: DtypeName | None = None
    """Must agree with the fp16/bf16 setting when given."""
    buffer_dtype: DtypeName | None = None
    """Cast buffers to this dtype (None: buffers keep their dtype, fp32 under fp16/bf16)."""
    keep_in_fp32_modules: Literal["auto"] | list[str] = "auto"
    """Buffers kept in fp32 under fp16/bf16 training (brought to fp32, left out of `buffer_dtype`): "auto", the
    Hugging Face model's own lists (`_keep_in_fp32_modules_strict`, and `_keep_in_fp32_modules` under fp16);
    or name patterns (`*` any characters); `[]`: none. Parameters always follow the training dtype."""


class ThroughputTimerConfig(ConfigModel):
    """`timers.throughput`."""

    enabled: bool = True
    """Measure samples/sec between optimizer steps."""
    synchronized: bool = True
    """Synchronize the device before reading the clock (exact, costs a sync per step on GPUs)."""


class TimersConfig(ConfigModel):
    """`timers`."""

    throughput: ThroughputTimerConfig = ThroughputTimerConfig()
    """The throughput timer."""


class FlopsProfilerConfig(ConfigModel):
    """`flops_profiler`: profile one optimizer step on rank 0 and print (or write) per-module params, MACs, latency."""

    enabled: bool = False
    """Profile the step `profile_step`."""
    recompute_fwd_factor: NonNegFloat = 0.0
    """Forward recomputations per backward (activation checkpointing), for the estimated backward flops
    `(2 + factor) x forward`; ds also prints the measured backward flops."""
    profile_step: NonNegInt = 1
    """The optimizer step to profile (counted from 0 before it runs; 1 lets one step warm up)."""
    module_depth: Int = -1
    """Deepest module level shown (-1: all)."""
    top_modules: PosInt = 1
    """Module classes listed per depth in the aggregated profile."""
    detailed: bool = True
    """Also print the per-module tree."""
    output_file: str | None = None
    """Write the profile to this file instead of stdout."""

    @field_validator("module_depth")
    @classmethod
    def _depth(cls, value: int) -> int:
        if value < -1:
            raise ValueError(f"module_depth must be -1 (all) or >= 0, got {value}")
        return value


class TorchAutocastConfig(ConfigModel):
    """`torch_autocast`: run the engine's forward under `torch.autocast` (parameters keep their dtype)."""

    enabled: bool = False
    """Run `engine(...)` under `torch.autocast`."""
    dtype: DtypeName | None = None
    """fp16 or bf16 (torch names too: "torch.bfloat16"); None: the device's autocast default (bf16 on CPU,
    fp16 on CUDA)."""
    lower_precision_safe_modules: list[str] | None = None
    """Qualified class names whose parameters are tagged lower-precision safe (None: Linear, Conv1d/2d/3d)."""

    @field_validator("dtype")
    @classmethod
    def _half(cls, value: str | None) -> str | None:
        if value == "fp32":
            raise ValueError("autocast to fp32 does nothing; use fp16 or bf16 (or disable torch_autocast)")
        return value
