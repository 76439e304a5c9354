"""`DeepSpeedEngine`: the training loop's object. forward, backward, step; everything else is wired in.

The engine holds objects initialize() built (a stepper, a scheduler, a reporter, timers) and
counters; the step path reads no config. See `_engine/assembly.py` for how the parts are made.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import ds_comm
from ds_engine._checkpoint import moe_checkpoint as _moe_checkpoint
from ds_engine._checkpoint.checkpointer import Checkpointer, CheckpointParts
from ds_engine._checkpoint.file_writer import CheckpointFileWriter
from ds_engine._data.loader import CurriculumDataLoader
from ds_engine._engine.assembly import EngineParts
from ds_engine._engine.checkpoint_names import EngineCheckpointNames
from ds_engine._engine.compile import EngineCompile
from ds_engine._engine.consolidated import ConsolidatedWeights
from ds_engine._engine.data_efficiency import EngineDataEfficiency
from ds_engine._engine.dataloader import DeepSpeedDataLoader, make_curriculum_loader, make_dataloader
from ds_engine._engine.deepspeed_getters import DeepSpeedGetters
from ds_engine._engine.grad_reduce import EngineGradReduce
from ds_engine._engine.loss_checks import check_scalar_loss
from ds_engine._engine.mixed_precision import EngineMixedPrecision
from ds_engine._engine.module_state import EngineModuleState
from ds_engine._engine.offload_states import (
    BACKWARD_NEEDS,
    FORWARD_NEEDS,
    SAVE_NEEDS,
    STEP_NEEDS,
    EngineOffloadStates,
)
from ds_engine._engine.queries import EngineQueries
from ds_engine._engine.sync_contexts import EngineSyncContexts
from ds_engine._engine.zenflow import EngineZenFlow
from ds_engine._report.autotuning import step_probes
from ds_engine._step.autocast import AutocastPolicy
from ds_engine._step.loss_scale_guard import LossScaleGuard

logger = logging.getLogger(__name__)

__all__ = ["DeepSpeedEngine"]


def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_floats(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast_floats(v, dtype) for k, v in value.items()}
    return value


class DeepSpeedEngine(
    EngineQueries,
    EngineDataEfficiency,
    DeepSpeedGetters,
    EngineMixedPrecision,
    EngineOffloadStates,
    EngineGradReduce,
    EngineSyncContexts,
    EngineCompile,
    ConsolidatedWeights,
    EngineModuleState,
    EngineCheckpointNames,
    EngineZenFlow,
    nn.Module,
):
    """Wraps the user's model for training with DeepSpeed's loop: `loss = engine(batch)`, `engine.backward(loss)`,
    `engine.step()`.

    Build it with `ds_engine.initialize(...)`. Attributes not found on the engine are looked up on
    the wrapped `engine.module`.

    Gradient accumulation is managed by default: `backward` divides the loss by
    `gradient_accumulation_steps`, and `step()` applies an update only at the boundary (every
    `gradient_accumulation_steps`-th call), advancing `micro_steps` on every call. With
    `"managed_gradient_accumulation": false` every `step()` is a boundary.
    """

    #: DeepSpeed's static helper: a model-states dict plus this rank's experts from their files.
    load_moe_state_dict = staticmethod(_moe_checkpoint.load_moe_state_dict)
    #: With `expert_parallel.enabled`: what AutoEP converted (ds-parallel's `ConversionReport`: the preset, each
    #: replaced block and where its experts live; `.lines()` prints it); None otherwise. Set by initialize().
    autoep_report: Any = None

    def __init__(self, parts: EngineParts) -> None:
        super().__init__()
        self.module = parts.module
        self._ds_config = parts.config
        self._plan = parts.plan
        self._dist = parts.dist
        self.device = parts.device
        self._stepper = parts.stepper
        self.optimizer = parts.optimizer
        self.basic_optimizer = parts.basic_optimizer
        self.parameter_offload = parts.parameter_offload
        self._tp = parts.tensor_parallel
        self._moe = parts.moe
        self._autocast = parts.autocast or AutocastPolicy(parts.plan.device_type)
        self.has_moe_layers = parts.moe is not None
        self.num_experts: list[int] = parts.moe.num_experts if parts.moe is not None else []
        self.moe_layers: list[nn.Module] = (  # DeepSpeed-MoE's MOELayers (AutoEP layers are not among them)
            [
                parts.module.get_submodule(layer.prefix).deepspeed_moe
                for layer in parts.moe.layers
                if not layer.fused_experts
            ]
            if parts.moe is not None
            else []
        )
        self.optimized_linear_lora_enabled = parts.optimized_linear.lora_enabled
        self.optimized_linear_base_weight_sharding = parts.optimized_linear.base_weight_sharding
        self.lr_scheduler = parts.lr_scheduler
        self.training_dataloader = parts.training_dataloader
        self.timers = parts.timers
        self.monitor = parts.monitor
        self._reporter = parts.reporter
        #: DeepSpeed's samples/sec timer: started at each forward, stopped at each step() (see `_timers`).
        self.tput_timer = parts.reporter.throughput
        self._collate_fn = parts.collate_fn
        m = parts.config.parsed
        self._ckpt_config = m.checkpoint
        self._zero_settings = parts.config.zero
        self._gas = parts.config.gradient_accumulation_steps
        #: ZenFlow's schedule (`ds_zero.ZenFlowSchedule`) when the optimizer runs it: the optimizer decides the
        #: boundaries, and each loss is divided by the fixed update interval (DeepSpeed sets
        #: gradient_accumulation_steps to it; not divided with the adaptive "auto" interval).
        self._zenflow = getattr(parts.optimizer, "zenflow_schedule", None)
        if self._zenflow is not None:
            self._gas = self._zenflow.loss_divisor
        self._micro_batch = parts.config.train_micro_batch_size_per_gpu
        self._train_batch = parts.config.train_batch_size
        self._managed = m.managed_gradient_accumulation
        self._input_dtype = torch.float16 if m.fp16.enabled and m.fp16.auto_cast else None
        # set_gradient_accumulation_boundary()'s override until the next step (None: count micro steps);
        # DeepSpeed's attribute name, which its tests and some trainers read.
        self._is_gradient_accumulation_boundary: bool | None = None
        self._in_no_sync = False
        self._step_applied = False
        self._loss_sum: torch.Tensor | None = None
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._flops, self._autotuning, self._model_info = step_probes(
            self,
            self.module,
            m.flops_profiler,
            m.autotuning,
            rank=self._dist.global_rank,
            train_batch_size=self._train_batch,
            gas=self._gas,
        )
        self.flops_profiler = self._flops.profiler if self._flops is not None else None
        self._loss_scale_guard = LossScaleGuard(self.loss_scale)
        self._init_data_efficiency(
            parts.config.raw, train_batch_size=self._train_batch, micro_batch_size=self._micro_batch
        )
        self._checkpointer = self._make_checkpointer(parts)

    def _make_checkpointer(self, parts: EngineParts) -> Checkpointer:
        """The object that saves and loads this engine's checkpoints (the pipeline engine makes its own kind)."""
        return Checkpointer(self, self._checkpoint_parts(parts))

    def _checkpoint_parts(self, parts: EngineParts) -> CheckpointParts:
        return CheckpointParts(
            stepper=parts.stepper,
            zero=parts.config.zero,
            moe=parts.moe,
            tensor_parallel=parts.tensor_parallel,
            dist=parts.dist,
            device=parts.device,
            settings=parts.config.parsed.checkpoint,
            ds_config=parts.config.raw,
            file_writer=CheckpointFileWriter(
                parts.config.parsed.checkpoint.writer, parts.config.parsed.aio, parts.dist, parts.device
            ),
        )

    # -- passthrough ------------------------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules", {})
            if "module" in modules:
                return getattr(modules["module"], name)
            raise

    # -- the loop ---------------------------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the wrapped module (inputs cast to fp16 first when `fp16.auto_cast`; under `torch.autocast` as the
        `torch_autocast` section says, see `_step/autocast.py`)."""
        self._check_states_loaded("engine.forward()", FORWARD_NEEDS)
        self.tput_timer.start()
        self.timers.start("forward")
        if self._input_dtype is not None:
            inputs, kwargs = _cast_floats(inputs, self._input_dtype), _cast_floats(kwargs, self._input_dtype)
        if self._autotuning is not None:
            self._autotuning.micro_step_began(self.global_steps)
        self._random_ltd_step()
        with self._autocast.forward_context(), self._forward_observers():
            out = self._call_module(*inputs, **kwargs)
        self._loss_scale_guard.arm(out)
        self.timers.stop("forward")
        return out

    def _forward_observers(self) -> contextlib.AbstractContextManager[None]:
        """What watches a forward: the flops profiler on its step, the autotuning model profile."""
        if self._flops is None and self._model_info is None:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        if self._flops is not None:
            stack.enter_context(self._flops.forward(self.global_steps))
        if self._model_info is not None:
            stack.enter_context(self._model_info.forward())
        return stack

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of `loss` into the gradient accumulators.

        The loss is divided by `gradient_accumulation_steps` (when `scale_wrt_gas`), multiplied by
        the loss scale (fp16), and back-propagated. No collective runs here at stage 0: gradients are
        reduced at the boundary in `step()`.

        Returns:
            the loss divided by `gradient_accumulation_steps` (when `scale_wrt_gas`), before any loss
            scale: what was back-propagated, as DeepSpeed returns it.

        Raises:
            RuntimeError: no optimizer was configured.
            LossNotScalarError: `loss` is not a scalar tensor that requires grad (a ValueError).
        """
        if self._stepper is None:
            raise self._no_optimizer("engine.backward()")
        check_scalar_loss(loss, "engine.backward(loss)")
        self._check_states_loaded("engine.backward()", BACKWARD_NEEDS)
        self.timers.start("backward")
        if self._reporter.needs_loss:
            detached = loss.detach().float().reshape(())
            self._loss_sum = detached if self._loss_sum is None else self._loss_sum + detached
        scaled = loss / self._gas if scale_wrt_gas and self._gas > 1 else loss
        self.timers.start("backward_inner")
        hint = getattr(self._stepper, "set_step_boundary", None)
        if hint is not None:  # ZeRO-Infinity may update sub-groups during the backward that ends the window
            hint(self.is_gradient_accumulation_boundary())
        with self._loss_scale_guard.engine_backward(), self._compiled_backward():
            if self._flops is None:
                self._stepper.backward(scaled, retain_graph)
            else:
                with self._flops.backward(self.global_steps):
                    self._stepper.backward(scaled, retain_graph)
        self.timers.stop("backward_inner")
        self._reduce_at_boundary()
        self.timers.stop("backward")
        return scaled

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss a script may back-propagate itself (`engine.scale(loss).backward()`, then `engine.step()`).

        Divided by `gradient_accumulation_steps` and multiplied by the loss scale, exactly what
        `backward` back-propagates, at every ZeRO stage: ZeRO's gradient hooks reduce (and stage 3
        releases parameters) during whichever backward runs, so a script's own `.backward()` on this
        loss leaves the same gradients as `engine.backward(loss)`. (`engine.backward` additionally tells a
        ZeRO-Infinity optimizer whether this backward ends the window, which lets it step NVMe sub-groups
        early; with `scale()` they are stepped in `step()`.)

        Raises:
            RuntimeError: no optimizer was configured.
            LossNotScalarError: `loss` is not a scalar tensor that requires grad (a ValueError).
        """
        if self._stepper is None:
            raise self._no_optimizer("engine.scale()")
        check_scalar_loss(loss, "engine.scale(loss)")
        return self._backward_prologue(loss)

    def _backward_prologue(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> torch.Tensor:
        """DeepSpeed's name for what `backward` propagates: `scale(loss)` (`scale_wrt_gas=False`: only the
        loss scale). For scripts that run `.backward()` themselves and then `_backward_epilogue()`."""
        scaled = loss / self._gas if scale_wrt_gas and self._gas > 1 else loss
        factor = self._stepper.loss_scale if self._stepper is not None else 1.0
        if factor == 1.0:
            return scaled
        scaled = scaled * factor
        self._loss_scale_guard.mark_scaled(scaled)
        return scaled

    def _backward_epilogue(self) -> None:
        """Finish a backward the script ran itself (`loss.backward()`, e.g. one loss over several engines):
        what `backward` does once autograd is done. At stage 0 with fp16/bf16 that moves the 16-bit
        gradients into the fp32 accumulation buffer (so the next backward does not add to them in 16 bits),
        and at the window's boundary the stage-0 gradients are reduced; ZeRO's gradient hooks need nothing more."""
        finish = getattr(self._stepper, "after_backward", None)
        if finish is not None:
            finish()
        self._reduce_at_boundary()

    def _reduce_at_boundary(self) -> None:
        """The backward that ends the accumulation window reduces the stage-0 gradients, as DeepSpeed's does, so
        code between `backward` and `step` (a gradient read, a norm, a client clip) sees the averaged values.
        Not inside `no_sync()` and not with `enable_backward_allreduce` off; `step()` reduces whatever is left."""
        if self.enable_backward_allreduce and not self._in_no_sync:
            self.allreduce_gradients()

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next `step()` applies an update: every `gradient_accumulation_steps`-th micro step."""
        if self._is_gradient_accumulation_boundary is not None:
            return self._is_gradient_accumulation_boundary
        if not self._managed:
            return True
        if self._zenflow is not None:
            return bool(self.optimizer.is_zenflow_update_boundary(self.micro_steps))
        return (self.micro_steps + 1) % self._gas == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Override the boundary decision for the next `step()` (reset after it).

        Raises:
            ds_comm.UsageError: `managed_gradient_accumulation` is false (every `step()` is the boundary).
        """
        if not self._managed:
            raise ds_comm.UsageError(
                "set_gradient_accumulation_boundary() is not supported with managed_gradient_accumulation=false: "
                "the caller owns the boundary, and every step() is one"
            )
        self._is_gradient_accumulation_boundary = bool(is_boundary)

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """At the boundary: reduce, (unscale, check), clip, update, step the lr scheduler; always count the micro step.

        On an overflow (fp16, bf16 with `check_grad_overflow`, fp32 under ZeRO; one order at every
        stage: `ds_ops.precision.finish_step`) the update and the scheduler step are skipped and
        `skipped_steps` grows; `global_steps` counts every boundary, as in DeepSpeed.
        Collectives (stage 0, several ranks): one all-reduce per gradient bucket on the
        data-parallel group.
        """
        if self._stepper is None:
            raise self._no_optimizer("engine.step()")
        self._refuse_step_in_sync_context()
        self._check_states_loaded("engine.step()", STEP_NEEDS)
        boundary = self.is_gradient_accumulation_boundary()
        if self._zenflow is not None:
            self.optimizer._sync_selective_optimizer_lr()
        if boundary:
            if self._flops is None:
                self._take_model_step(lr_kwargs)
            else:
                with self._flops.step(self.global_steps):
                    self._take_model_step(lr_kwargs)
        else:
            self._step_applied = False
            if self._zenflow is not None and self.lr_scheduler is not None:
                self.lr_scheduler.step(**(lr_kwargs or {}))  # ZenFlow steps the schedule every micro step
        self._is_gradient_accumulation_boundary = None
        self.tput_timer.stop(global_step=boundary)
        if boundary:
            self._report_step()
            self._checkpointer.at_step_boundary()  # a decoupled save's commit, once its files are written
        self.micro_steps += 1
        if boundary and self._autotuning is not None:
            self._autotuning.optimizer_step_ended(self.global_steps)  # ends the process after the last timed step

    def _no_optimizer(self, call: str) -> RuntimeError:
        stage3 = (
            " (ZeRO stage 3 still partitions and gathers the parameters for forward)"
            if self.parameter_offload is not None
            else ""
        )
        return RuntimeError(
            f"{call} needs an optimizer: this engine was built without one, for evaluation only"
            f'{stage3}; add an "optimizer" section to the config or pass optimizer= to initialize()'
        )

    def _take_model_step(self, lr_kwargs: dict[str, Any] | None) -> None:
        self.timers.start("step")
        applied = self._stepper.step()
        self._step_applied = applied
        if applied:
            if self.lr_scheduler is not None:
                self.lr_scheduler.step(**(lr_kwargs or {}))
        else:
            self.skipped_steps += 1
        self.global_steps += 1
        self.global_samples += self._train_batch
        self.timers.stop("step")

    def _report_step(self) -> None:
        """The reporter's turn after an optimizer step (after the throughput timer took the step's time)."""
        loss = None
        if self._loss_sum is not None:
            loss, self._loss_sum = self._loss_sum / self._gas, None
        self._reporter.after_step(
            global_steps=self.global_steps,
            global_samples=self.global_samples,
            skipped_steps=self.skipped_steps,
            lrs=self.get_lr,
            loss_scale=lambda: self._stepper.loss_scale if self._stepper else 1.0,
            loss=loss,
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear accumulated gradients (the engine does this after every applied or skipped step)."""
        if self._stepper is not None:
            self._stepper.zero_grad()

    def was_step_applied(self) -> bool:
        """False when the last step() skipped its update (overflow, or not a boundary)."""
        return self._step_applied

    def train(self, mode: bool = True) -> DeepSpeedEngine:
        super().train(mode)
        return self

    def eval(self) -> DeepSpeedEngine:
        return self.train(False)

    def destroy(self) -> None:
        """Close monitors and destroy the optimizer (ZeRO's frees its natively pinned offload buffers);
        the engine must not be used afterwards. A decoupled save still in flight is finished and
        committed first (collective then; its failure is raised after the rest is released)."""
        try:
            self._checkpointer.close()
        finally:
            destroy_optimizer = getattr(self.optimizer, "destroy", None)
            if callable(destroy_optimizer):
                destroy_optimizer()
            if self.monitor is not None:
                self.monitor.close()

    # -- data -------------------------------------------------------------------------------------------
    def deepspeed_io(
        self,
        dataset: Any,
        batch_size: int | None = None,
        route: str = "train",
        pin_memory: bool = True,
        data_sampler: Any = None,
        collate_fn: Callable[..., Any] | None = None,
        num_local_io_workers: int | None = None,
    ) -> DeepSpeedDataLoader | CurriculumDataLoader:
        """A loader over `dataset` with the micro batch size, sharded across data-parallel ranks.

        Under `data_efficiency.data_sampling.curriculum_learning.enabled` it is the curriculum loader (any
        route, as in DeepSpeed): `data_sampler` and `num_local_io_workers` are then not used, the workers
        are `data_sampling.num_workers`.
        """
        if route not in ("train", "eval", "predict"):
            raise ValueError(f"deepspeed_io: route must be 'train', 'eval' or 'predict', got {route!r}")
        if self.curriculum_learning_enabled():
            return make_curriculum_loader(
                dataset,
                data_efficiency_config=self._ds_config.data_efficiency_config,
                batch_size=batch_size or self._micro_batch,
                dist=self._dist,
                gradient_accumulation_steps=self.gradient_accumulation_steps(),
                pin_memory=pin_memory,
                collate_fn=collate_fn or self._collate_fn,
                drop_last=self._ds_config.parsed.dataloader_drop_last,
            )
        return make_dataloader(
            dataset,
            batch_size=batch_size or self._micro_batch,
            dp_world_size=self._dist.dp_world_size,
            dp_rank=self._dist.dp_rank,
            pin_memory=pin_memory,
            data_sampler=data_sampler,
            collate_fn=collate_fn or self._collate_fn,
            num_workers=num_local_io_workers or 0,
            drop_last=self._ds_config.parsed.dataloader_drop_last,
            shuffle=route == "train",
        )

    # -- checkpoints ------------------------------------------------------------------------------------
    def save_checkpoint(
        self,
        save_dir: str,
        tag: Any = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Save module, optimizer (loss scaler, fp32 masters, ZeRO partitions), scheduler, counters and RNG.

        Collective: every rank must call it. Files go under `save_dir/<tag>` (default tag
        `global_step<N>`), each through `ds_comm.atomic_save` (temporary name, fsync, rename); after
        all ranks finished, rank 0 points `save_dir/latest` at the tag. A crash mid-save leaves
        `latest` on the previous tag.
        `client_state` entries are stored beside the engine's and returned by `load_checkpoint`.

        With `checkpoint.layout: "deepspeed"` the files are DeepSpeed 0.19.8's (`_deepspeed_layout`: built
        in a staging directory from a ds save, then published with one rename before `latest` moves).
        """
        self._check_states_loaded("engine.save_checkpoint()", SAVE_NEEDS)
        return self._checkpointer.save(save_dir, tag, client_state, save_latest, exclude_frozen_parameters)

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
        """Load `load_dir/<tag>` (default: the tag in `load_dir/latest`); returns `(path, client_state)`.

        Without a `latest` file it logs a warning and returns `(None, None)`, as DeepSpeed does.
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

    def save_16bit_model(
        self, save_dir: str, save_filename: str = "pytorch_model.bin", exclude_frozen_parameters: bool = False
    ) -> bool:
        """Rank 0 writes the module's state_dict (parameters in the training dtype) to `save_dir/save_filename`.

        Collective under ZeRO stage 3: every rank must call it; parameters are gathered one module at a
        time, and only with `stage3_gather_16bit_weights_on_model_save` (otherwise a warning, no file,
        and False, as in DeepSpeed). Returns True when the file was written.
        """
        self._raise_if_autoep_zero3_consolidated_export("save_16bit_model")
        return self._checkpointer.save_16bit_model(save_dir, save_filename, exclude_frozen_parameters)

    save_fp16_model = save_16bit_model
