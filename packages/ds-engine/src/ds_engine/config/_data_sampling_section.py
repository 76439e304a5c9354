"""`data_efficiency.data_sampling`: curriculum learning by data sampling and dynamic batching.

`curriculum_learning.enabled` makes `engine.deepspeed_io()` (and the training loader initialize() builds)
draw batches with `DeepSpeedDataSampler` from the data analyzer's index files, as DeepSpeed 0.19.8 does.
`dynamic_batching.enabled` lets `get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(dataset,
engine)` pack sequences into batches of at most `max_tokens` with the lr scaled per batch; as in DeepSpeed,
the engine itself does not change its loader for it. Both are checked here, when switched on, so a
missing or bad setting is an error naming its key before anything is built.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import model_validator
from pydantic_core import PydanticCustomError

from ds_comm import ConfigModel
from ds_engine._data.curriculum_schedule import ScheduleConfigError, validate_metric

__all__ = ["CurriculumLearningConfig", "DataSamplingConfig", "DynamicBatchingConfig"]


def _key_error(key: str, message: str) -> PydanticCustomError:
    # reported as "<section path>.<key>: <message>" by ds_comm's error formatter
    return PydanticCustomError("unsupported_key", "{message}", {"key": key, "message": message})


class CurriculumLearningConfig(ConfigModel):
    """`data_efficiency.data_sampling.curriculum_learning`."""

    enabled: bool = False
    """Sample training data by the curriculum (DeepSpeedDataSampler) in `deepspeed_io`."""
    data_cluster_path: str | None = None
    """Directory for the sampler's cluster files (written by data-parallel rank 0)."""
    curriculum_metrics: dict[str, dict[str, Any]] = {}
    """Metric name -> `index_to_sample_path`, `index_to_metric_path`, `difficulty_type` (value/percentile),
    `clustering_type`, `min_difficulty`, `max_difficulty`, `schedule_type`, `schedule_config`."""

    @model_validator(mode="after")
    def _check_enabled(self) -> CurriculumLearningConfig:
        if not self.enabled:
            return self
        if not self.data_cluster_path:
            raise _key_error(
                "data_cluster_path",
                "is required when curriculum learning is enabled (a directory for the sampler's cluster files)",
            )
        if not self.curriculum_metrics:
            raise _key_error("curriculum_metrics", "needs at least one metric when curriculum learning is enabled")
        for name, metric in self.curriculum_metrics.items():
            try:
                validate_metric(metric)
            except ScheduleConfigError as err:
                raise _key_error(f"curriculum_metrics.{name}.{err.key}", err.message) from None
        return self


class DynamicBatchingConfig(ConfigModel):
    """`data_efficiency.data_sampling.dynamic_batching`: variable batch size and lr scaling."""

    enabled: bool = False
    metrics_path: str | None = None
    """Directory of the data analyzer's `seqlen` metric (read, or written when missing)."""
    lr_scaling_method: Literal["linear", "sqrt", "none"] = "linear"
    min_batch_size: int = 1
    max_batch_size: int | None = None
    sequence_picking_order: Literal["dataloader", "random", "seqlen"] = "dataloader"
    max_tokens: int | None = None
    """The most tokens (summed sequence lengths) in a micro batch; required when enabled."""
    verbose: bool = False

    @model_validator(mode="after")
    def _check_enabled(self) -> DynamicBatchingConfig:
        if self.min_batch_size < 1:
            raise _key_error("min_batch_size", f"must be >= 1, got {self.min_batch_size}")
        if self.max_batch_size is not None and self.max_batch_size < self.min_batch_size:
            raise _key_error("max_batch_size", f"{self.max_batch_size} is below min_batch_size {self.min_batch_size}")
        if self.enabled and (self.max_tokens is None or self.max_tokens <= 0):
            raise _key_error(
                "max_tokens", f"must be an int > 0 when dynamic batching is enabled, got {self.max_tokens!r}"
            )
        return self


class DataSamplingConfig(ConfigModel):
    """`data_efficiency.data_sampling`."""

    enabled: bool = False
    """DeepSpeed reports it (`engine.data_sampling_enabled()`); the sub-switches act on their own."""
    num_epochs: int = 1000
    """Epochs of the dataset the curriculum sampler serves before it stops."""
    num_workers: int = 0
    """DataLoader worker processes of the curriculum loader (and the dynamic-batching one)."""
    pin_memory: bool = False
    curriculum_learning: CurriculumLearningConfig = CurriculumLearningConfig()
    dynamic_batching: DynamicBatchingConfig = DynamicBatchingConfig()

    @model_validator(mode="after")
    def _check_counts(self) -> DataSamplingConfig:
        if self.num_epochs < 1:
            raise _key_error("num_epochs", f"must be >= 1, got {self.num_epochs}")
        if self.num_workers < 0:
            raise _key_error("num_workers", f"must be >= 0, got {self.num_workers}")
        return self
