"""An autotuning experiment's side in the engine: time the profile steps, write the metrics, end the process.

`deepspeed --autotuning tune` (ds-launcher) launches the user's script once per candidate config with
`autotuning.enabled: true` and a `metric_path` in that experiment's result folder, and reads the file
back; nothing else passes between the two. The engine therefore does three things here:

- `ExperimentProbe` times each optimizer step whose index (0-based, `global_steps` before the step) lies
  in `start_profile_step..end_profile_step`, from the first forward of its window to the end of its
  `step()`, as DeepSpeed sums its forward, backward and step timers (the time the script spends between
  steps, e.g. loading data, is left out). After step `end_profile_step` rank 0 writes the metrics JSON and
  every rank ends with status 0 (DeepSpeed calls `exit()` at the same point).
- The metrics file carries DeepSpeed's keys: `latency` (ms per optimizer step, the median over the timed
  steps, where DeepSpeed takes the mean: one step slowed by another process on the host must not decide
  between two configs), `throughput` (samples per second: `train_batch_size` / latency), `FLOPS_per_gpu` (floating-point
  operations per second on rank 0), plus `flops` (the same value under the name the `metric: "flops"`
  setting reads), `latency_mean` (ms, the mean), `num_profiled_steps` and `train_batch_size`.
- The flops come from ds's flops profiler run on the step before the window (on the first step when the
  window starts at 0), so its module hooks do not slow the timed steps. It counts forward and backward
  of the step's last micro-batch (measured, where DeepSpeed multiplies the forward by 3), times
  `gradient_accumulation_steps`.

`ModelInfoProbe` is the `model_info.profile` run the autotuner starts first when the config gives no
`model_info.num_params`: it counts the parameters, measures the activation memory of one forward as the
bytes autograd saves for backward (parameters excluded, each storage once), writes them to
`model_info_path` and ends the process after that forward.
"""

from __future__ import annotations

import contextlib
import json
import logging
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ds_comm import atomic_write_text, get_accelerator
from ds_engine._report.flops_step import StepFlopsProfile

if TYPE_CHECKING:
    from ds_engine._report.flops_profiler.profiler import FlopsProfiler
    from ds_engine.config._autotuning import AutotuningConfig

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_METRIC_FILE",
    "DEFAULT_MODEL_INFO_FILE",
    "ExperimentProbe",
    "ModelInfoProbe",
    "end_experiment",
    "step_probes",
]

#: Where the metrics go when `autotuning.metric_path` is not set (DeepSpeed's name, in the working directory).
DEFAULT_METRIC_FILE = "autotuning_metric.json"
#: Where the model profile goes when `autotuning.model_info_path` is not set.
DEFAULT_MODEL_INFO_FILE = "autotuning_model_info.json"


def end_experiment() -> None:
    """End this rank's process with status 0 once every rank got here.

    Collective: a barrier on the default group when one exists, so no rank leaves while a peer still
    reads from it; the process groups are then destroyed by ds-comm's exit hook.
    """
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    raise SystemExit(0)


def _write_json(path: str, payload: dict[str, Any]) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(target, json.dumps(payload, indent=2, sort_keys=True) + "\n")


class ExperimentProbe:
    """Times the profile window of an autotuning experiment and ends the run after it.

    Args:
        settings: the `autotuning` section (`enabled` true).
        train_batch_size: samples per optimizer step, all ranks together.
        gradient_accumulation_steps: micro-batches per optimizer step.
        rank: this process's global rank (rank 0 writes).
        on_done: called after the metrics are written (default `end_experiment`); tests pass their own.
    """

    def __init__(
        self,
        settings: AutotuningConfig,
        *,
        train_batch_size: int,
        gradient_accumulation_steps: int,
        rank: int,
        on_done: Callable[[], None] = end_experiment,
    ) -> None:
        self.start_step = settings.start_profile_step
        self.end_step = settings.end_profile_step
        self.metric_path = settings.metric_path or DEFAULT_METRIC_FILE
        self.train_batch_size = train_batch_size
        self.gas = gradient_accumulation_steps
        self.rank = rank
        self._on_done = on_done
        self._began: float | None = None
        self._step_s: list[float] = []
        self._flops_per_step: float | None = None

    @property
    def flops_step(self) -> int:
        """The optimizer step the flops profiler measures: the one before the timed window."""
        return max(self.start_step - 1, 0)

    @staticmethod
    def _now() -> float:
        get_accelerator().synchronize()
        return time.perf_counter()

    def micro_step_began(self, global_steps: int) -> None:
        """A forward (or a pipeline batch) starts; the first one of a timed step starts its clock."""
        if self._began is None and self.start_step <= global_steps <= self.end_step:
            self._began = self._now()

    def record_flops(self, profiler: FlopsProfiler) -> None:
        """The flops profiler finished its step: forward + backward flops of the last micro-batch."""
        self._flops_per_step = float(int(profiler.get_total_flops()) + profiler.backward_flops) * self.gas

    def optimizer_step_ended(self, global_steps: int) -> None:
        """The optimizer step `global_steps - 1` finished; after the window's last one, report and end."""
        if self._began is not None:
            self._step_s.append(self._now() - self._began)
            self._began = None
        if global_steps != self.end_step + 1:
            return
        metrics = self.metrics()
        if self.rank == 0:
            _write_json(self.metric_path, metrics)
            where = Path(self.metric_path).resolve()
            logger.info("autotuning: wrote the metrics of steps %d..%d to %s", self.start_step, self.end_step, where)
        self._on_done()

    def metrics(self) -> dict[str, float | int]:
        """The metrics of the steps timed so far (DeepSpeed's keys; see the module docstring)."""
        latency_s = statistics.median(self._step_s) if self._step_s else 0.0
        mean_s = statistics.fmean(self._step_s) if self._step_s else 0.0
        flops_per_s = (self._flops_per_step or 0.0) / latency_s if latency_s > 0 else 0.0
        return {
            "latency": latency_s * 1e3,
            "throughput": self.train_batch_size / latency_s if latency_s > 0 else 0.0,
            "FLOPS_per_gpu": flops_per_s,
            "flops": flops_per_s,
            "latency_mean": mean_s * 1e3,
            "num_profiled_steps": len(self._step_s),
            "train_batch_size": self.train_batch_size,
        }


class ModelInfoProbe:
    """The `model_info.profile` run: model size and activation memory of one forward, then the end.

    Args:
        module: the wrapped model (parameters already placed and, at stage 3, partitioned).
        path: `autotuning.model_info_path` (None: `autotuning_model_info.json` here).
        rank: this process's global rank (rank 0 writes).
        on_done: called after the file is written (default `end_experiment`).
    """

    def __init__(
        self, module: nn.Module, path: str | None, *, rank: int, on_done: Callable[[], None] = end_experiment
    ) -> None:
        self.module = module
        self.path = path or DEFAULT_MODEL_INFO_FILE
        self.rank = rank
        self._on_done = on_done
        params = list(module.parameters())
        self.num_params = sum(int(getattr(p, "ds_numel", p.numel())) for p in params)
        self.trainable_num_params = sum(int(getattr(p, "ds_numel", p.numel())) for p in params if p.requires_grad)

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Wraps the first forward: counts what autograd saves for backward, then writes and ends."""
        param_storages = {p.untyped_storage().data_ptr() for p in self.module.parameters() if p.numel()}
        saved: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in param_storages and not isinstance(tensor, nn.Parameter):
                saved[ptr] = storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        info = {
            "num_params": self.num_params,
            "trainable_num_params": self.trainable_num_params,
            "activation_mem_per_gpu": sum(saved.values()),
        }
        if self.rank == 0:
            _write_json(self.path, info)
            logger.info("autotuning: wrote the model profile to %s", Path(self.path).resolve())
        self._on_done()


def step_probes(
    engine: Any,
    module: nn.Module,
    flops_profiler: Any,
    settings: AutotuningConfig,
    *,
    rank: int,
    train_batch_size: int,
    gas: int,
) -> tuple[StepFlopsProfile | None, ExperimentProbe | None, ModelInfoProbe | None]:
    """What watches the engine's steps: the flops profile (rank 0, `flops_profiler.enabled`), an autotuning
    experiment's probe, or the model-info probe (`autotuning.enabled`).

    During an experiment the flops profiler measures for the probe (on the step before the timed ones) and
    prints nothing, whatever the `flops_profiler` section says.
    """
    flops = StepFlopsProfile(module, engine, flops_profiler) if flops_profiler.enabled and rank == 0 else None
    if not settings.enabled:
        return flops, None, None
    if settings.model_info is not None and settings.model_info.profile:
        return flops, None, ModelInfoProbe(module, settings.model_info_path, rank=rank)
    probe = ExperimentProbe(settings, train_batch_size=train_batch_size, gradient_accumulation_steps=gas, rank=rank)
    if rank == 0:
        # the user's flops_profiler section, switched on at the step before the timed window
        profile = flops_profiler.model_copy(
            update={"enabled": True, "profile_step": probe.flops_step, "detailed": False}
        )
        flops = StepFlopsProfile(module, engine, profile, on_profiled=probe.record_flops)
    return flops, probe, None
