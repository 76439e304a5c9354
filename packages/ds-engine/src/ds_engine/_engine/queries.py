"""DeepSpeed's query methods on the engine (batch sizes, precision, ZeRO, lr, ranks): read-only, off the step path."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ds_engine._plan.dist_info import DistInfo
    from ds_engine._plan.plan import AssemblyPlan
    from ds_engine.config import DeepSpeedConfig, ZeroSettings

__all__ = ["EngineQueries"]


class EngineQueries:
    """Mixed into `DeepSpeedEngine`; every method answers from values resolved at initialize()."""

    _ds_config: DeepSpeedConfig
    _plan: AssemblyPlan
    _dist: DistInfo
    _zero_settings: ZeroSettings
    _ckpt_config: Any
    _gas: int
    _micro_batch: int
    _train_batch: int
    _stepper: Any
    optimizer: Any
    timers: Any

    # -- config views -----------------------------------------------------------------------------------
    @property
    def config(self) -> dict[str, Any]:
        """The config dict as the user wrote it (DeepSpeed's `engine.config`)."""
        return self._ds_config.raw

    @property
    def _config(self) -> DeepSpeedConfig:
        return self._ds_config

    # -- batch ------------------------------------------------------------------------------------------
    def train_batch_size(self) -> int:
        return self._train_batch

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._micro_batch

    def gradient_accumulation_steps(self) -> int:
        return self._gas

    def get_batch_info(self) -> tuple[int, int, int]:
        """(train_batch_size, micro batch, gradient_accumulation_steps) as values (DeepSpeed returns the methods)."""
        return self._train_batch, self._micro_batch, self._gas

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch by changing gradient_accumulation_steps (micro batch and ranks stay).

        Raises:
            ValueError: `train_batch_size` is not a multiple of micro batch x data-parallel size.
        """
        replicas = self._dist.replica_world_size
        unit = self._micro_batch * replicas
        if train_batch_size <= 0 or train_batch_size % unit:
            raise ValueError(
                f"Train batch size must be divisible by micro-batch data parallelism: {train_batch_size} "
                f"is not a multiple of {self._micro_batch} x {replicas} = {unit}"
            )
        self._gas = train_batch_size // unit
        self._train_batch = train_batch_size

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """Change the micro batch, keeping gradient_accumulation_steps (the global batch follows)."""
        if micro_batch_size <= 0:
            raise ValueError(f"micro batch size must be > 0, got {micro_batch_size}")
        self._micro_batch = micro_batch_size
        self._train_batch = micro_batch_size * self._gas * self._dist.replica_world_size

    # -- precision, clipping, ZeRO ----------------------------------------------------------------------
    def fp16_enabled(self) -> bool:
        return self._plan.precision == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self._plan.precision == "bf16"

    def dynamic_loss_scale(self) -> bool:
        return self._plan.dynamic_loss_args is not None

    def loss_scale(self) -> float:
        return self._stepper.loss_scale if self._stepper is not None else 1.0

    def gradient_clipping(self) -> float:
        # From the config, as DeepSpeed reads it (callers pass stand-ins with only `_config`).
        return self._config.gradient_clipping

    def zero_optimization(self) -> bool:
        return self._zero_settings.stage > 0

    def zero_optimization_stage(self) -> int:
        return self._zero_settings.stage

    def zero_optimization_partition_gradients(self) -> bool:
        return self._zero_settings.stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self._zero_settings.stage >= 3

    def load_universal_checkpoint(self) -> bool:
        """Whether `load_checkpoint` reads universal checkpoints (`checkpoint.load_universal`)."""
        return bool(self._ckpt_config.load_universal)

    def zero_offload_optimizer(self) -> Any:
        """The `zero_optimization.offload_optimizer` section as given, None when absent (DeepSpeed's answer)."""
        cfg = self._zero_settings.zero_config
        return cfg.offload_optimizer if cfg is not None else None

    def zero_offload_param(self) -> Any:
        """The `zero_optimization.offload_param` section as given, None when absent (DeepSpeed's answer)."""
        cfg = self._zero_settings.zero_config
        return cfg.offload_param if cfg is not None else None

    def zero_cpu_offload(self) -> bool:
        return self._zero_settings.offload_optimizer_device == "cpu"

    def zero_use_cpu_optimizer(self) -> bool:
        return self._zero_settings.offload_optimizer_device in ("cpu", "nvme")

    # -- logging settings -------------------------------------------------------------------------------
    def steps_per_print(self) -> int | None:
        return self._ds_config.parsed.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self._ds_config.parsed.wall_clock_breakdown

    def get_wall_clock_timers(self) -> dict[str, float]:
        """Milliseconds per timer since the last progress line."""
        return self.timers.snapshot()

    def optimizer_name(self) -> str | None:
        return self._ds_config.optimizer_name

    def optimizer_params(self) -> dict[str, Any] | None:
        return self._ds_config.optimizer_params

    def scheduler_name(self) -> str | None:
        return self._ds_config.scheduler_name

    def scheduler_params(self) -> dict[str, Any] | None:
        return self._ds_config.scheduler_params

    # -- optimizer state --------------------------------------------------------------------------------
    def _groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups if self.optimizer is not None else []

    def get_lr(self) -> list[float]:
        """The lr of each param group."""
        return [float(g["lr"]) for g in self._groups()]

    def get_mom(self) -> list[Any]:
        """`betas` (Adam family) or `momentum` (SGD, RMSprop) of each param group."""
        return [g["betas"] if "betas" in g else g.get("momentum") for g in self._groups()]

    def get_type(self) -> list[Any]:
        return [g.get("type") for g in self._groups()]

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm at the last step (None for fp32 stage 0 without clipping, as in DeepSpeed)."""
        return self._stepper.global_grad_norm if self._stepper is not None else None

    # -- ranks ------------------------------------------------------------------------------------------
    @property
    def local_rank(self) -> int:
        return self._dist.local_rank

    @property
    def global_rank(self) -> int:
        return self._dist.global_rank

    @property
    def world_size(self) -> int:
        return self._dist.world_size

    @property
    def dp_world_size(self) -> int:
        return self._dist.dp_world_size

    @property
    def seq_dp_world_size(self) -> int:
        """Data-parallel size including sequence parallelism (none here: the data-parallel size)."""
        return self._dist.dp_world_size

    @property
    def mp_world_size(self) -> int:
        return self._dist.mp_world_size

    @property
    def _dp_rank(self) -> int:
        return self._dist.dp_rank

    @property
    def _mp_rank(self) -> int:
        return self._dist.mp_rank

    @property
    def checkpoint_mp_rank(self) -> int:
        return self._dist.mp_rank

    def get_data_parallel_rank(self) -> int:
        return self._dist.dp_rank

    def get_model_parallel_rank(self) -> int:
        return self._dist.mp_rank

    def get_tensor_parallel_rank(self) -> int:
        return self._dist.mp_rank

    def autotp_size(self) -> int:
        """`tensor_parallel.autotp_size`, filled from `tp_model_init` when the config left it unset (0: off)."""
        return int(self._ds_config.parsed.tensor_parallel.autotp_size)

    #: Whether this engine runs a pipeline schedule (`PipelineEngine` says True). A plain attribute, as in
    #: DeepSpeed, so that code (and tests) may set it on an instance.
    pipeline_parallelism: bool = False
