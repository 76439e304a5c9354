"""`PipelineEngine`: `DeepSpeedEngine` for a `ds_pipe.PipelineModule`, driving ds-pipe's `PipelineExecutor`.

The optimizer side is the ordinary engine's (assemble() with the module's grid as the mpu, so the
data-parallel group is the grid's): the executor runs the 1F1B `TrainSchedule` over
`gradient_accumulation_steps` micro-batches, and its `OptimizerStep` calls the engine's stepper,
which reduces gradients over the data-parallel group (stage 0 all-reduce, or ZeRO-1's partitioned
reduction) and updates. Clipping spans all stages (`clip.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

import ds_comm
from ds_engine._engine.assembly import EngineParts
from ds_engine._engine.engine import DeepSpeedEngine
from ds_engine._optional import require
from ds_engine._pipeline.checkpoint import PipelineCheckpointer
from ds_engine._pipeline.clip import PipelineGradClipper
from ds_ops.precision import local_overflow

logger = logging.getLogger(__name__)

__all__ = ["PipelineEngine", "PipelineError", "PipelineSettings"]

_ONLY_TRAIN_BATCH = "Only train_batch() is accessible in pipeline mode."


class PipelineError(RuntimeError):
    """A call that pipeline mode does not allow (forward/backward/step: use train_batch()).

    What the engine raises also derives from `ds_pipe.PipelineError`, so either handler catches it.
    """


@dataclasses.dataclass(frozen=True)
class PipelineSettings:
    """What the `pipeline` section and the precision plan decide for the executor (resolved once)."""

    pipe_partitioned: bool = True
    grad_partitioned: bool = True
    clip: float = 0.0
    """`gradient_clipping`, applied over the whole pipeline (the stepper itself is built with 0)."""
    input_dtype: torch.dtype | None = None
    """Floating inputs of the first stage are cast to this (the training dtype under fp16/bf16)."""
    scale_loss: bool = False
    """Multiply each micro-batch loss by the stepper's loss scale before backward (fp16)."""
    agree_overflow: bool = False
    """The stepper skips steps on inf/nan gradients: make every stage skip together (see `_agree_on_overflow`)."""


@functools.cache
def _pipeline_error_type() -> type[Exception]:
    """An error both `ds_engine.PipelineError` and `ds_pipe.PipelineError` handlers catch."""
    ds_pipe = require("ds_pipe", extra="pipe", feature="pipeline parallelism")
    return type("PipelineError", (PipelineError, ds_pipe.PipelineError), {"__module__": __name__})


def _repeat(loader: Iterable[Any]) -> Iterator[Any]:
    """Cycle through `loader` forever (DeepSpeed's RepeatingLoader)."""
    while True:
        yield from loader


def _cast_inputs(batch: Any, dtype: torch.dtype) -> Any:
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        return batch  # the executor reports the malformed batch
    inputs, labels = batch
    if isinstance(inputs, torch.Tensor):
        inputs = inputs.to(dtype) if inputs.is_floating_point() else inputs
    elif isinstance(inputs, (tuple, list)):
        inputs = type(inputs)(
            t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in inputs
        )
    return inputs, labels


class PipelineEngine(DeepSpeedEngine):
    """Trains a `ds_pipe.PipelineModule` with `train_batch()`; built by `initialize()` for such a module.

    Each rank holds one stage of one pipeline replica. `train_batch(data_iter)` draws
    `gradient_accumulation_steps` micro-batches `(inputs, labels)` (first and last stage; the others
    may pass None), runs the 1F1B schedule, reduces gradients over the data-parallel replicas, clips
    by the global norm over every stage, steps the optimizer and the lr scheduler once, and returns
    the mean loss on every stage. `forward`, `backward` and `step` raise `PipelineError`.

    Collectives per `train_batch`: p2p between neighbouring stages, all-reduces over tie groups and
    the data-parallel group (or ZeRO-1's reduction), a broadcast of the loss over the pipe group,
    and with clipping two one-element all-reduces (data-parallel under ZeRO, and pipeline).
    """

    pipeline_parallelism: bool = True

    def __init__(self, parts: EngineParts, settings: PipelineSettings) -> None:
        super().__init__(parts)
        ds_pipe = require("ds_pipe", extra="pipe", feature="pipeline parallelism")
        module = parts.module
        self.grid = module.mpu()
        self.num_stages = self.grid.get_pipe_parallel_world_size()
        self.stage_id = self.grid.get_stage_id()
        self._settings = settings
        self._has_attention_mask = False
        self._clipper: PipelineGradClipper | None = None
        if settings.clip > 0 and self.basic_optimizer is not None:
            self._clipper = PipelineGradClipper(
                max_norm=settings.clip,
                tied=module.get_tied_weights_and_groups(),
                model_group=self.grid.get_model_parallel_group() if self.num_stages > 1 else None,
                dp_group=self._dist.dp_group,
                dp_world_size=self._dist.dp_world_size,
                partitioned=self._zero_settings.stage > 0,
                device=self.device,
            )
            self.basic_optimizer.register_step_pre_hook(self._clipper)
        # One stage checks its own gradients; with several, the stages agree first (`_agree_on_overflow`).
        self._agree_overflow = settings.agree_overflow and self.num_stages > 1
        self._skip: torch.Tensor | None = None
        self._user_batch_fn: Callable[[Any], Any] | None = None
        self._executor = ds_pipe.PipelineExecutor(
            module,
            micro_batches=self._gas,
            optimizer_step=self._optimizer_step,
            grid=self.grid,
            reduce_grads=self._before_step,
            scale_loss=self._scale_loss if settings.scale_loss else None,
            batch_fn=self._batch_fn if settings.input_dtype is not None else None,
            pipe_partitioned=settings.pipe_partitioned,
            grad_partitioned=settings.grad_partitioned,
            device=self.device,
            broadcast_parameters=False,
        )
        if self.training_dataloader is not None:
            self.set_dataiterator(_repeat(self.training_dataloader))

    # -- the pipeline loop ------------------------------------------------------------------------------
    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """One optimizer step over `gradient_accumulation_steps` micro-batches; the mean loss on every stage.

        Args:
            data_iter: yields `(inputs, labels)` micro-batches (read on the first and last stage);
                default the iterator from `set_dataiterator` / `set_dataloader` / `training_data`.

        Raises:
            RuntimeError: no optimizer, or gradients are disabled (`torch.no_grad()`).
            ValueError: the first or last stage has no data.
        """
        if self._stepper is None:
            raise RuntimeError(
                'train_batch() needs an optimizer: add an "optimizer" section to the config or '
                "pass optimizer= to initialize()"
            )
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled. Use eval_batch() instead.")
        if self._autotuning is not None:
            self._autotuning.micro_step_began(self.global_steps)
        self.tput_timer.start()
        self.timers.start("train_batch")
        self._random_ltd_step()  # every micro-batch of this batch runs at the same kept length, as in DeepSpeed
        loss = self._executor.train_batch(data_iter)
        self.micro_steps += self._gas
        self.timers.stop("train_batch")
        self.tput_timer.stop(global_step=True)
        self._reporter.after_step(
            global_steps=self.global_steps,
            global_samples=self.global_samples,
            skipped_steps=self.skipped_steps,
            lrs=self.get_lr,
            loss_scale=lambda: self._stepper.loss_scale if self._stepper else 1.0,
            loss=loss.detach().float(),
        )
        if self._autotuning is not None:
            self._autotuning.optimizer_step_ended(self.global_steps)  # ends the process after the last timed step
        return loss

    def eval_batch(
        self,
        data_iter: Iterator[Any] | None = None,
        return_logits: bool = False,
        compute_loss: bool = True,
        reduce_output: str | None = "avg",
        bcast_loss: bool = True,
        num_micro_batches: int | None = None,
    ) -> Any:
        """Forward of one batch with the `InferenceSchedule` (no grad); see `ds_pipe.PipelineExecutor.eval_batch`.

        Returns the loss averaged over micro-batches and data-parallel replicas (`reduce_output="avg"`)
        or the per-micro-batch list (`None`), on every stage with `bcast_loss`; with
        `return_logits`, `(loss, logits)` where the logits are the last stage's outputs (None elsewhere).
        """
        return self._executor.eval_batch(
            data_iter,
            return_logits=return_logits,
            compute_loss=compute_loss,
            reduce_output=reduce_output,
            bcast_loss=bcast_loss,
            num_micro_batches=num_micro_batches,
        )

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Not available: raises `PipelineError` (use `train_batch()` / `eval_batch()`)."""
        raise _pipeline_error_type()(_ONLY_TRAIN_BATCH)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Not available: raises `PipelineError` (use `train_batch()`)."""
        raise _pipeline_error_type()(_ONLY_TRAIN_BATCH)

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """Not available: raises `PipelineError` (use `train_batch()`)."""
        raise _pipeline_error_type()(_ONLY_TRAIN_BATCH)

    # -- executor callbacks -----------------------------------------------------------------------------
    def _before_step(self) -> None:
        # The stepper reduces over the data-parallel group itself (stage-0 all-reduce, ZeRO's reduction);
        # the executor's own averaging would double it. Only the clipper and the skip agreement look first.
        if self._agree_overflow:
            self._skip = self._agree_on_overflow()
        if self._clipper is not None:
            self._clipper.note_duplicates()

    def _agree_on_overflow(self) -> torch.Tensor:
        """A 1-element flag, the same on every rank: 1.0 when any stage of any replica has an inf/nan gradient.

        [Note: why] Each stepper checks overflow over the gradients it holds (one stage; the
        data-parallel reduction spreads it over that stage's replicas). One MAX all-reduce of this
        rank's flag over every rank of the pipeline grid (all stages, all replicas) hands each stepper
        the same skip decision (`Stepper.step(skip=...)`), so the skip, and the loss-scale update, is
        identical everywhere. The flag stays on the device: the stepper's own step reads it back
        together with its overflow check, in its one host sync.
        """
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        flag = local_overflow(grads).to(self.device)
        ds_comm.all_reduce(flag, op=ds_comm.ReduceOp.MAX, group=None)
        return flag

    def _scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        assert self._stepper is not None
        scale = self._stepper.loss_scale
        return loss * scale if scale != 1.0 else loss

    def _batch_fn(self, batch: Any) -> Any:
        if self._user_batch_fn is not None:
            batch = self._user_batch_fn(batch)
        assert self._settings.input_dtype is not None
        return _cast_inputs(batch, self._settings.input_dtype)

    def _optimizer_step(self) -> None:
        assert self._stepper is not None
        self.timers.start("step")
        applied = self._stepper.step(skip=self._skip)
        self._skip = None
        self._step_applied = applied
        if applied:
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        else:
            self.skipped_steps += 1
        self.global_steps += 1
        self.global_samples += self._train_batch
        self.timers.stop("step")

    # -- data feeding -----------------------------------------------------------------------------------
    def set_dataiterator(self, iterator: Iterator[Any]) -> None:
        """The iterator `train_batch()` / `eval_batch()` read when called without one."""
        self._executor.set_dataiterator(iterator)

    def set_dataloader(self, loader: Iterable[Any]) -> None:
        """Read micro-batches from `loader`, restarting it when exhausted (first and last stage)."""
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = loader
            self.set_dataiterator(_repeat(loader))

    def set_batch_fn(self, fn: Callable[[Any], Any]) -> None:
        """Apply `fn` to every batch drawn from the data iterator."""
        if self._settings.input_dtype is not None:
            self._user_batch_fn = fn
        else:
            self._executor.batch_fn = fn

    def reset_activation_shape(self) -> None:
        """Exchange activation shapes again on the next batch (call on every stage together)."""
        self._executor.reset_activation_shape()

    def set_has_attention_mask(self, value: bool) -> None:
        """Kept for DeepSpeed scripts; ds-pipe sends tuples of tensors (a mask included) as they are."""
        self._has_attention_mask = bool(value)

    # -- batch size -------------------------------------------------------------------------------------
    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch by changing the micro-batches per `train_batch` (see the base class)."""
        super().set_train_batch_size(train_batch_size)
        self._executor.set_micro_batches(self._gas)

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        raise _pipeline_error_type()(
            "set_train_micro_batch_size() is not supported in pipeline mode: the micro "
            "batch is whatever the data iterator yields; use set_train_batch_size()"
        )

    # -- stage info -------------------------------------------------------------------------------------
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def get_pipeline_parallel_rank(self) -> int:
        return self.stage_id

    def _reentrant_activation_checkpointing(self) -> bool:
        """Whether the module checkpoints its blocks now, with the reentrant function (DeepSpeed's query).

        Read from the module (its interval and `activation_checkpoint_func`), not the config, so a later
        `set_checkpoint_interval` counts. DeepSpeed uses it to make the first stage's inputs require
        grad; ds-pipe's reentrant checkpoint passes a grad-requiring dummy through instead, so here it
        only reports.
        """
        ds_pipe = require("ds_pipe", extra="pipe", feature="pipeline parallelism")
        module: Any = self.module  # a ds_pipe.PipelineModule
        if module.activation_checkpoint_interval <= 0:
            return False
        return module.activation_checkpoint_func is not ds_pipe.checkpointing.non_reentrant_checkpoint

    def get_global_grad_norm(self) -> float | None:
        """The global norm over every stage at the last step when clipping is on, else the stepper's."""
        if self._clipper is not None:
            return self._clipper.last_norm
        return super().get_global_grad_norm()

    def timings(self) -> dict[str, float]:
        """Seconds per schedule instruction in the last batch (ds-pipe's executor timings)."""
        return self._executor.timings()

    # -- checkpoints ------------------------------------------------------------------------------------
    def _make_checkpointer(self, parts: EngineParts) -> PipelineCheckpointer:
        """Layer files and a per-stage state (`_pipeline.checkpoint`); the stage layout is read at save/load."""
        return PipelineCheckpointer(self, self._checkpoint_parts(parts))

    def save_checkpoint(
        self,
        save_dir: str,
        tag: Any = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Save per-layer weights, per-stage engine state and (ZeRO) per-rank optimizer partitions.

        Layout of `save_dir/<tag>`: `layer_XX-model_states.pt` (one per layer, by global index,
        written by data-parallel rank 0 of the owning stage), `mp_rank_{stage:02d}_model_states.pt`
        (`module` None; optimizer at stage 0, lr scheduler, counters, RNG of every rank, the
        partition) and with ZeRO `zero_pp_rank_{dp}_mp_rank_{stage:02d}_optim_states.pt`.
        Collective; `latest` is switched by rank 0 once every rank has written.
        """
        return super().save_checkpoint(save_dir, tag, client_state, save_latest, exclude_frozen_parameters)

    def load_checkpoint(
        self,
        load_dir: str,
        tag: Any = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Callable[..., Any] | None = None,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """Load a pipeline checkpoint; the layer weights load with any number of stages.

        The optimizer state loads only into the same stage layout (stages and partition) it was saved
        with; otherwise pass `load_optimizer_states=False` (or `load_module_only=True`): weights,
        lr scheduler and counters are restored and the optimizer starts afresh.

        Raises:
            ValueError: optimizer states requested across a different stage layout, or `custom_load_fn`.
            FileNotFoundError: the tag or a layer file is missing.
        """
        return self._checkpointer.load(
            load_dir,
            tag,
            load_module_strict,
            load_optimizer_states,
            load_lr_scheduler_states,
            load_module_only,
            custom_load_fn,
        )

    def layout(self) -> dict[str, Any]:
        """The stage layout a checkpoint's optimizer state depends on."""
        return {"num_stages": self.num_stages, "partitions": self.module.partitions()}
