"""The whole ds_config as one model: every top-level key DeepSpeed 0.19.8 reads, known, refused, or inert."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BeforeValidator, StrictBool

from ds_comm import CommsLoggerConfig, ConfigModel
from ds_engine.config._autotuning import AutotuningConfig
from ds_engine.config._compile_section import CompileConfig
from ds_engine.config._feature_sections import (
    DataEfficiencyConfig,
    ExpertParallelConfig,
)
from ds_engine.config._hybrid_engine import HybridEngineConfig
from ds_engine.config._log_levels import log_level_value
from ds_engine.config._sections import (
    BF16Config,
    CheckpointConfig,
    CometConfig,
    CSVMonitorConfig,
    DataTypesConfig,
    FlopsProfilerConfig,
    FP16Config,
    OptimizerConfig,
    SchedulerConfig,
    TensorBoardConfig,
    TimersConfig,
    TorchAutocastConfig,
    WandbConfig,
)
from ds_engine.config._tensor_parallel import TensorParallelConfig
from ds_engine.config._types import DtypeName, NonNegFloat, PosFloat, PosInt, StepInterval
from ds_ops import AioConfig

__all__ = ["DeepSpeedConfigModel"]

_REMOVED = "was removed in DeepSpeed 0.19 and is not implemented in ds"

#: Keys DeepSpeed knows that ds refuses, with the reason shown to the user.
UNSUPPORTED_KEYS: dict[str, str] = {
    "amp": 'NVIDIA Apex AMP was removed (DeepSpeed 0.19 rejects it too); use "bf16": {"enabled": true} '
    '(recommended where supported) or "fp16": {"enabled": true}',
    "nebula": f"Nebula checkpointing {_REMOVED}",
    "compression_training": f"compression training {_REMOVED}",
    "quantize_training": f"quantization-aware training {_REMOVED}",
    "sparse_gradients": f"sparse gradients {_REMOVED}",
    "eigenvalue": f"eigenvalue computation {_REMOVED}",
    "sparse_attention": f"sparse attention {_REMOVED}",
    "elasticity": f"elastic training {_REMOVED}",
    "graph_harvesting": f"graph harvesting {_REMOVED}",
    "progressive_layer_drop": f"progressive layer drop {_REMOVED}",
    "curriculum_learning": "top-level curriculum learning was removed in DeepSpeed 0.19; use "
    "data_efficiency.data_sampling.curriculum_learning (curriculum data sampling) instead",
}


def _section_or_bool(value: Any) -> Any:
    if value is not None and not isinstance(value, (dict, bool)):
        raise ValueError(f"expected a section (object) or true/false, got {value!r}")
    return value


def _section(value: Any) -> Any:
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"expected a section (object), got {value!r}")
    return value


def _lower(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


def _allreduce_op(value: Any) -> Any:
    # DeepSpeed's wording ("Invalid gradient_allreduce_op"), which its users and tests match on.
    op = _lower(value)
    if op not in ("mean", "sum"):
        raise ValueError(f"Invalid gradient_allreduce_op {value!r}: use 'mean' or 'sum'")
    return op


def _log_level_name(value: str | None) -> str | None:
    if value is not None:
        log_level_value(value)  # raises ValueError naming the allowed names
    return value


def _datastates_off(value: Any) -> Any:
    if value is not None and value is not False:
        raise ValueError(
            f"DataStates checkpointing is not implemented in ds; only false is accepted (DeepSpeed turns it "
            f"on for any other value), got {value!r}"
        )
    return value


class DeepSpeedConfigModel(ConfigModel):
    """Every top-level key of a ds_config (sections are models of their own).

    Unknown keys are errors with a suggestion (DeepSpeed ignores them silently). Keys DeepSpeed removed
    are errors that say so. Every key DeepSpeed 0.19.8 reads is a field: a feature ds lacks keeps its
    keys and refuses only the value that asks for it (`inert_keys`, the sections of
    `_feature_sections`), and a key nothing in ds acts on is accepted with a warning (`ignored_keys`).
    `zero_optimization` is validated by ds-zero's `ZeroConfig`, `weight_quantization` by ds-zero's model,
    and `pipeline` / `activation_checkpointing` by ds-pipe's models (lazily, since both are optional
    extras), so here they are raw.
    """

    unsupported_keys: ClassVar[dict[str, str]] = UNSUPPORTED_KEYS
    deprecated_keys: ClassVar[dict[str, str]] = {"bfloat16": "bf16"}
    ignored_keys: ClassVar[dict[str, str]] = {
        "disable_allgather": "DeepSpeed 0.19.8 reads it but nothing acts on it",
    }
    inert_keys: ClassVar[dict[str, str]] = {
        "disable_python_gc": "the engine does not manage Python's garbage collector",
    }

    train_batch_size: PosInt | None = None
    """Global batch per optimizer step = micro batch x gradient_accumulation_steps x data-parallel size."""
    train_micro_batch_size_per_gpu: PosInt | None = None
    """Samples per rank per forward/backward."""
    gradient_accumulation_steps: PosInt | None = None
    """Micro steps per optimizer step."""
    managed_gradient_accumulation: bool = True
    """False: every step() applies an update; the script owns the accumulation boundary."""
    optimizer: OptimizerConfig | None = None
    """Built when initialize() gets no optimizer."""
    scheduler: SchedulerConfig | None = None
    """Built when initialize() gets no lr_scheduler."""
    fp16: FP16Config = FP16Config()
    """fp16 mixed precision."""
    bf16: BF16Config = BF16Config()
    """bf16 mixed precision."""
    gradient_clipping: NonNegFloat = 1.0
    """Clip gradients to this global L2 norm (0: off). DeepSpeed 0.19's default is 1.0."""
    prescale_gradients: bool = False
    """Divide gradients by the data-parallel size before the all-reduce rather than after."""
    gradient_predivide_factor: PosFloat = 1.0
    """Divide by this before the all-reduce and by (dp size / factor) after (overflow/underflow control)."""
    gradient_allreduce_op: Annotated[Literal["mean", "sum"], BeforeValidator(_allreduce_op)] = "mean"
    """Average ("mean") or add ("sum") gradients across data-parallel ranks."""
    communication_data_type: DtypeName | None = None
    """dtype of gradient all-reduces (None: the accumulation dtype)."""
    sequence_parallel_size: PosInt = 1
    """Ulysses sequence-parallel degree; must equal the mpu's (initialize() builds the mesh when no mpu is given)."""
    data_parallel_size: PosInt | None = None
    """The data-parallel degree of the (data, sequence) mesh initialize() builds from `sequence_parallel_size`
    (DeepSpeed reads it only there): it must then be the world size / sequence_parallel_size. Without
    `sequence_parallel_size` it has no effect (a warning says so); the data-parallel degree is what the
    world size and the other degrees leave."""
    tensor_parallel: TensorParallelConfig = TensorParallelConfig()
    """Automatic tensor parallelism in training (`autotp_size`); initialize() builds the mesh and shards the model."""
    seq_parallel_communication_data_type: Annotated[DtypeName, BeforeValidator(_lower)] = "fp32"
    """dtype of gradient reductions when sequence_parallel_size > 1 (it replaces communication_data_type)."""
    steps_per_print: StepInterval = None
    """Log progress every N optimizer steps (None, or `inf` as Accelerate writes it: never)."""
    wall_clock_breakdown: bool = False
    """Time forward/backward/all-reduce/step and log them every steps_per_print steps."""
    memory_breakdown: bool = False
    """Log device memory with the progress line."""
    dump_state: bool = False
    """Log the resolved config and wrapper chain at initialize()."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """Checkpoint options."""
    tensorboard: TensorBoardConfig = TensorBoardConfig()
    """TensorBoard monitor."""
    csv_monitor: CSVMonitorConfig = CSVMonitorConfig()
    """CSV monitor."""
    wandb: WandbConfig = WandbConfig()
    """wandb monitor."""
    comet: CometConfig = CometConfig()
    """Comet monitor."""
    data_types: DataTypesConfig = DataTypesConfig()
    """Accumulation, parameter and buffer dtypes."""
    timers: TimersConfig = TimersConfig()
    """Throughput timer."""
    zero_allow_untested_optimizer: bool = False
    """Allow ZeRO with an optimizer outside Adam/AdamW/Adagrad/Lamb/Lion."""
    zero_force_ds_cpu_optimizer: bool = True
    """With optimizer offload, require a DeepSpeed CPU optimizer."""
    zero_optimization: Annotated[dict[str, Any] | StrictBool | None, BeforeValidator(_section_or_bool)] = None
    """ZeRO; validated by ds_zero.ZeroConfig (true/false is the legacy form of stage 1/0)."""
    comms_logger: CommsLoggerConfig = CommsLoggerConfig()
    """Collective-communication logging (ds-comm)."""
    pipeline: Annotated[dict[str, Any] | None, BeforeValidator(_section)] = None
    """Pipeline engine options; validated by ds_pipe.PipelineConfig (see `_pipe_sections.py`)."""
    activation_checkpointing: Annotated[dict[str, Any] | None, BeforeValidator(_section)] = None
    """Activation checkpointing options; validated by ds_pipe.ActivationCheckpointingConfig."""
    weight_quantization: Annotated[dict[str, Any] | None, BeforeValidator(_section)] = None
    """ZeRO-Inference weight quantization read by zero.Init; validated by ds_zero.WeightQuantizationConfig."""
    flops_profiler: FlopsProfilerConfig = FlopsProfilerConfig()
    """Flops profiler (one step, rank 0)."""
    hybrid_engine: HybridEngineConfig = HybridEngineConfig()
    """The RLHF hybrid engine (training plus fast generation in one engine)."""
    torch_autocast: TorchAutocastConfig = TorchAutocastConfig()
    """torch's autocast around the engine's forward."""
    aio: AioConfig = AioConfig()
    """Async I/O for NVMe offload; validated by ds_ops.AioConfig, handed to ds-zero's stage 3 with nvme offload."""
    dataloader_drop_last: bool = False
    """deepspeed_io() drops the last incomplete batch."""
    vocabulary_size: PosInt | None = None
    """Warn when not a multiple of 8 (tensor-core friendly)."""
    disable_allgather: bool = False
    """A legacy switch DeepSpeed reads and never acts on; no effect (a warning says so)."""
    use_data_before_expert_parallelism: bool = False
    """MoE layers lay their groups out data-before-expert (D + E): expert-data-parallel groups of consecutive
    ranks, expert-parallel groups strided over them (default E + D: expert-parallel groups consecutive)."""
    disable_python_gc: bool = False
    log_level: Annotated[str | None, AfterValidator(_log_level_name)] = None
    """Level of the ds packages' loggers, set at initialize() (debug, info, warning, error, critical, any
    case; kept as written, as DeepSpeed's `engine.log_level()` returns it)."""
    datastates_ckpt: Annotated[Literal[False] | None, BeforeValidator(_datastates_off)] = None
    """DataStates asynchronous checkpointing (DeepSpeed enables it for any value but false); only false."""
    compile: CompileConfig = CompileConfig()
    """DeepCompile's settings (see `_compile_section`)."""
    autotuning: AutotuningConfig = AutotuningConfig()
    """The autotuner's settings; `enabled` makes this run an autotuning experiment (see `AutotuningConfig`)."""
    data_efficiency: DataEfficiencyConfig = DataEfficiencyConfig()
    """Curriculum learning, dynamic batching, random-LTD; every `enabled` only false."""
    expert_parallel: ExpertParallelConfig = ExpertParallelConfig()
    """AutoEP; only `enabled: false` (expert parallelism itself is the MoE layer's `ep_size`)."""
