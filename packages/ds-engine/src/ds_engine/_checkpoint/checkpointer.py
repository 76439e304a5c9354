"""`Checkpointer`: save and load of a `DeepSpeedEngine`, behind the small `CheckpointedEngine` protocol.

The engine's `save_checkpoint` / `load_checkpoint` / `save_16bit_model` delegate here. What the
checkpointer needs comes in two parts, so it never reads an engine's private fields:

* `CheckpointParts`: what the engine was built from and never changes (its stepper, ZeRO settings,
  MoE wiring, tensor-parallel state, rank layout, the `checkpoint` section), handed over once;
* `CheckpointedEngine`: the engine's live training state (module, counters, lr scheduler) and its
  module state_dict I/O, read at save time and restored at load time.

The file layout, the atomic writer and the pure readers are `_checkpoint.checkpoint`; the pipeline
engine's per-layer files and stage layout are `_pipeline.checkpoint.PipelineCheckpointer`, a subclass.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

import ds_comm
from ds_engine._checkpoint import checkpoint as _checkpoint
from ds_engine._checkpoint import deepspeed_layout as _deepspeed_layout
from ds_engine._checkpoint import moe_checkpoint as _moe_checkpoint
from ds_engine._checkpoint import tp_optimizer_state as _tp_optimizer_state
from ds_engine._checkpoint import universal_autoep as _universal_autoep
from ds_engine._checkpoint import universal_tp as _universal_tp
from ds_engine._checkpoint.decoupled import DecoupledWriter, PendingCheckpoint, file_saver
from ds_engine._checkpoint.file_writer import CheckpointFileWriter
from ds_engine._checkpoint.train_state import (
    ENGINE_KEYS,
    Counters,
    TrainState,
    curriculum_sampler,
    curriculum_sampler_state,
    restored_counters,
    rng_state,
    set_rng_state,
)
from ds_engine._optional import require
from ds_engine._parallel.tensor_parallel import TensorParallelState
from ds_engine._plan.dist_info import DistInfo
from ds_engine._step.moe import MoeWiring
from ds_engine._step.steppers import Stepper

if TYPE_CHECKING:  # the config sections need pydantic, which an import of ds_engine does not load
    from ds_engine.config import CheckpointConfig, ZeroSettings

logger = logging.getLogger(__name__)

__all__ = ["CheckpointParts", "CheckpointedEngine", "Checkpointer"]


class CheckpointedEngine(Protocol):
    """What a `Checkpointer` reads from and restores into: the engine's live training state.

    Data efficiency's state is optional and read where present: `random_ltd_scheduler`, and the training
    loader's curriculum sampler (`training_dataloader` with `curriculum_learning_enabled()`).
    """

    module: nn.Module
    lr_scheduler: Any
    global_steps: int
    global_samples: int
    micro_steps: int
    skipped_steps: int

    def train_batch_size(self) -> int: ...

    def gradient_accumulation_steps(self) -> int: ...

    def module_state_dict(
        self,
        destination: dict[str, Any] | None = None,
        prefix: str = "",
        keep_vars: bool = False,
        exclude_frozen_parameters: bool = False,
    ) -> dict[str, Any]:
        """The module's weights, whole (gathered over tensor-parallel ranks)."""

    def load_module_state_dict(
        self, checkpoint: dict[str, Any], strict: bool = True, custom_load_fn: Callable[..., Any] | None = None
    ) -> None:
        """Load `checkpoint["module"]`, whole weights, into the module (cut to this rank's tensor-parallel shards)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointParts:
    """What an engine was built from that a checkpoint saves or loads into; fixed for the engine's life."""

    stepper: Stepper | None
    """The optimizer side (None: an engine without an optimizer saves weights and counters only)."""
    zero: ZeroSettings
    moe: MoeWiring | None
    tensor_parallel: TensorParallelState | None
    dist: DistInfo
    device: torch.device
    """Where rank-agreement collectives (tag check, RNG gather) put their tensors."""
    settings: CheckpointConfig
    """The config's `checkpoint` section (layout, serialization, tag validation, universal loading)."""
    ds_config: dict[str, Any]
    """The config as the user gave it, recorded in every model-states and partition file."""
    file_writer: CheckpointFileWriter | None = None
    """How files are written (`checkpoint.writer`); None: `ds_comm.atomic_save`."""


def _random_ltd_state(engine: CheckpointedEngine) -> dict[str, Any] | None:
    """The random-LTD scheduler's state to save, when the engine has one (an engine without the attribute has none)."""
    scheduler = getattr(engine, "random_ltd_scheduler", None)
    return scheduler.state_dict() if scheduler is not None else None


class Checkpointer:
    """Saves and loads one engine's checkpoints (DeepSpeed's layout, written atomically).

    Subclasses (the pipeline engine's) change what is captured (`train_state`, `weights_writer`) and how a
    checkpoint loads (`load`); the tag, the RNG gather, the write and `latest` stay here.
    """

    replica_writes_allowed = True
    """`checkpoint.writer.data_parallel: replica` may have every data-parallel rank write the model states."""

    def __init__(self, engine: CheckpointedEngine, parts: CheckpointParts) -> None:
        self.engine = engine
        self.parts = parts
        # checkpoint.layout, decided once: ds's files, or DeepSpeed 0.19.8's (built from a ds save).
        self._write = (
            _deepspeed_layout.write_deepspeed_checkpoint
            if parts.settings.layout == "deepspeed"
            else _checkpoint.write_checkpoint
        )
        self.decoupled = self._make_decoupled(parts)
        """The background writer under `checkpoint.writer.decoupled: true` (`_checkpoint.decoupled`), else None."""

    @staticmethod
    def _make_decoupled(parts: CheckpointParts) -> DecoupledWriter | None:
        writer = parts.file_writer
        if writer is None or writer.settings is None or not writer.settings.decoupled:
            return None
        return DecoupledWriter(writer.save, parts.dist, parts.device)

    # -- decoupled writes --------------------------------------------------------------------------------
    def commit(self) -> bool:
        """Wait for a decoupled save's files on every rank and move `latest` (collective); False: nothing pending.

        Raises:
            DecoupledCheckpointError: a background write failed; `latest` names the last complete checkpoint.
        """
        return self.decoupled.commit() if self.decoupled is not None else False

    def at_step_boundary(self) -> None:
        """The optimizer step is done: commit a decoupled save whose files are all written (never waits)."""
        if self.decoupled is not None:
            self.decoupled.poll()

    def close(self) -> None:
        """Commit a pending decoupled save and stop its worker (collective when one is pending)."""
        if self.decoupled is not None:
            self.decoupled.close()

    # -- save --------------------------------------------------------------------------------------------
    def save(
        self,
        save_dir: str | Path,
        tag: Any = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """See `DeepSpeedEngine.save_checkpoint`. Collective: every rank calls it.

        Decoupled (`checkpoint.writer.decoupled`): the previous save is committed first (raising its failure),
        this one's files are queued and `latest` moves at its commit (`_checkpoint.decoupled`).
        """
        parts, dist, decoupled = self.parts, self.parts.dist, self.decoupled
        if decoupled is not None:
            decoupled.commit()
        tag = _checkpoint.resolve_save_tag(
            save_dir,
            tag,
            global_steps=self.engine.global_steps,
            tag_validation=parts.settings.tag_validation,
            world_size=dist.world_size,
            device=parts.device,
        )
        # DeepSpeed's files hold no RNG state and its load leaves the RNG alone (a program's data order after a
        # resume depends on that); ds's own layout saves every rank's RNG so a resumed run continues exactly.
        rng_states = (
            []
            if parts.settings.layout == "deepspeed"
            else _checkpoint.gather_rng(rng_state(), world_size=dist.world_size, device=parts.device)
        )
        partitioned = parts.zero.stage > 0 and parts.stepper is not None
        extra = self._tensor_parallel_extra(partitioned)
        writer = parts.file_writer if decoupled is None else decoupled
        replica = writer is not None and writer.replica_writes(
            zero_stage=parts.zero.stage, has_moe=parts.moe is not None
        )
        request = _checkpoint.SaveRequest(
            root=Path(save_dir),
            tag=tag,
            mp_rank=dist.mp_rank,
            dp_rank=dist.dp_rank,
            writes_latest=dist.global_rank == 0,
            serialization=parts.settings.checkpoint_serialization,
            ds_config=parts.ds_config,
            train_state=self.train_state(rng_states, exclude_frozen_parameters, extra)
            if dist.dp_rank == 0 or replica
            else None,
            zero_partition=parts.stepper.state_dict() if partitioned and parts.stepper is not None else None,
            zero_partition_extra=_moe_checkpoint.zero_folding_record(parts.moe, parts.stepper, self.engine.module, dist)
            if partitioned
            else {},
            client_state=dict(client_state or {}),
            save_latest=save_latest,
            write_weights=self.weights_writer(exclude_frozen_parameters),
            file_writer=writer,
            replica_model_states=replica,
        )
        if decoupled is None:
            self._write(request)
        elif parts.settings.layout == "deepspeed":  # its tag directory is built and renamed at the commit
            decoupled.begin(
                PendingCheckpoint(
                    Path(save_dir), tag, save_latest, _deepspeed_layout.stage_deepspeed_checkpoint(request)
                )
            )
        else:
            _checkpoint.write_checkpoint(dataclasses.replace(request, save_latest=False))
            decoupled.begin(PendingCheckpoint(Path(save_dir), tag, save_latest))
        return True

    def _tensor_parallel_extra(self, partitioned: bool) -> dict[str, Any]:
        """Engine keys a tensor-parallel save adds: the whole ZeRO optimizer state (stage 1/2,
        `_tp_optimizer_state`'s note; a stage-3 save loads at its own layout) and how each parameter is
        cut, for ds_to_universal (DeepSpeed's AutoTP records it)."""
        parts, module = self.parts, self.engine.module
        extra: dict[str, Any] = {}
        if parts.tensor_parallel is None:
            return extra
        if partitioned and parts.zero.stage < 3 and parts.stepper is not None:
            ds_zero = require("ds_zero", extra="zero", feature="saving a ZeRO checkpoint")
            whole = ds_zero.param_states_of(
                parts.stepper.optimizer,  # type: ignore[attr-defined]  # partitioned: a ZeroStepper
                transform=_tp_optimizer_state.whole_tensors(module),
                keep_tensors=parts.dist.global_rank == 0,  # the rank that writes it; the others only take part
            )
            if parts.dist.global_rank == 0:
                extra[_tp_optimizer_state.PARAM_STATES_KEY] = whole
        extra[_universal_tp.UNIVERSAL_INFO_KEY] = _universal_tp.universal_checkpoint_info(module)
        return extra

    def train_state(
        self, rng_states: list[dict[str, Any]], exclude_frozen_parameters: bool, extra: dict[str, Any] | None = None
    ) -> TrainState:
        """The engine's training state as a value, for the model-states file (`extra`: engine keys beside it).

        With tensor parallelism the stage-0 optimizer state is saved whole (`_tp_optimizer_state`).
        """
        parts, engine = self.parts, self.engine
        stepper, zero = parts.stepper, parts.zero.stage > 0
        shapes = shared = frozen_shapes = frozen_values = None
        module_state = engine.module_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
        if parts.moe is not None:  # experts live in their own files (`_moe_checkpoint`)
            module_state = _moe_checkpoint.non_expert_state(module_state, parts.moe)
        if zero and stepper is not None:
            # The ZeRO optimizer's groups hold flat partitions; ds-zero knows which parameters they hold.
            ds_zero = require("ds_zero", extra="zero", feature="saving a ZeRO checkpoint")
            shapes = [
                {name: torch.Size(shape) for name, shape in group.items()}
                for group in ds_zero.zero_param_shapes(stepper.optimizer, engine.module)  # type: ignore[attr-defined]
            ]
            # DeepSpeed's consolidation (its zero_to_fp32.py) reads tied and frozen parameters from these.
            shared = ds_zero.shared_param_names(engine.module)
            if not exclude_frozen_parameters and module_state is not None:
                trained = {name for group in shapes for name in group}
                frozen = [n for n, _ in engine.module.named_parameters() if n not in trained and n in module_state]
                frozen_shapes, frozen_values = ds_zero.frozen_fields(module_state, frozen, stage=parts.zero.stage)
        optimizer = stepper.state_dict() if not zero and stepper is not None and parts.moe is None else None
        if optimizer is not None and parts.tensor_parallel is not None:
            params = stepper.state_params()  # type: ignore[union-attr]  # every stage-0 stepper has it
            optimizer = _tp_optimizer_state.gather_stage0_state(optimizer, params, engine.module)
        dist = parts.dist
        return TrainState(
            module=module_state,
            buffer_names=[n for n, _ in engine.module.named_buffers()],
            optimizer=optimizer,
            param_shapes=shapes,
            shared_params=shared,
            frozen_param_shapes=frozen_shapes,
            frozen_param_fragments=frozen_values,
            lr_scheduler=engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
            counters=Counters(
                global_steps=engine.global_steps,
                global_samples=engine.global_samples,
                micro_steps=engine.micro_steps,
                skipped_steps=engine.skipped_steps,
            ),
            dp_world_size=dist.dp_world_size,
            mp_world_size=dist.mp_world_size,
            tp_degree=dist.mp_world_size,
            sp_degree=dist.sp_world_size,
            ds_config=parts.ds_config,
            rng_states=rng_states,
            data_sampler=curriculum_sampler_state(engine),
            extra={
                **(extra or {}),
                **(_moe_checkpoint.autoep_layers_entry(parts.moe, parts.zero.stage, extra) if parts.moe else {}),
                **_moe_checkpoint.folding_record(
                    parts.moe, family="dense", dp_rank=dist.dp_rank, names=list(module_state or {})
                ),
            },
            random_ltd=_random_ltd_state(engine),
        )

    def weights_writer(self, exclude_frozen_parameters: bool) -> Callable[[Path], None] | None:
        """Writes weights kept outside the model-states file: an MoE model's expert files (and, at stage 0,
        its per-expert-parallel-rank optimizer file; queued like the rest under a decoupled writer); nothing
        for a dense model, nor at stage 3, where the (AutoEP) experts live in the ZeRO partitions only, as in
        DeepSpeed, and load from there at any expert-parallel degree (`partitioned_expert_states`)."""
        parts, moe = self.parts, self.parts.moe
        if moe is None or parts.zero.stage == 3:
            return None
        save = file_saver(self.decoupled, serialization=parts.settings.checkpoint_serialization)
        stepper, mp_rank = parts.stepper, parts.dist.mp_rank
        stage0_optimizer = stepper.state_dict() if parts.zero.stage == 0 and stepper is not None else None
        module = self.engine.module

        def write(ckpt_dir: Path) -> None:
            _moe_checkpoint.write_expert_files(module, moe, ckpt_dir, mp_rank=mp_rank, save=save)
            if stage0_optimizer is not None:
                _moe_checkpoint.write_stage0_optimizer(stage0_optimizer, moe, ckpt_dir, mp_rank=mp_rank, save=save)

        return write

    def save_16bit_model(
        self, save_dir: str | Path, save_filename: str = "pytorch_model.bin", exclude_frozen_parameters: bool = False
    ) -> bool:
        """See `DeepSpeedEngine.save_16bit_model`.

        At stage 3 the full weights are assembled by `ds_zero.consolidated_16bit_state_dict`, which gathers
        one module's parameters at a time (the whole model is never gathered at once on any rank) and
        copies them to the CPU on rank 0. Without `stage3_gather_16bit_weights_on_model_save` nothing is
        written and False is returned (DeepSpeed does the same: the partitioned state_dict would be bogus).
        """
        parts, engine, rank0 = self.parts, self.engine, self.parts.dist.global_rank == 0
        if parts.zero.stage == 3:
            if not parts.zero.gather_16bit_weights_on_model_save:
                logger.warning(
                    "save_16bit_model: nothing saved; under ZeRO stage 3 the parameters are partitioned, set "
                    "zero_optimization.stage3_gather_16bit_weights_on_model_save=true to gather and save them"
                )
                return False
            ds_zero = require("ds_zero", extra="zero", feature="ZeRO stage 3 save_16bit_model")
            state = ds_zero.consolidated_16bit_state_dict(
                engine.module, rank0_only=True, exclude_frozen_parameters=exclude_frozen_parameters
            )
        elif parts.tensor_parallel is not None or rank0:  # tensor parallel: whole weights gathered (a collective)
            state = engine.module_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
        else:
            state = {}
        if rank0:
            path = Path(save_dir)
            path.mkdir(parents=True, exist_ok=True)
            if self.decoupled is not None:
                self.decoupled.drain()  # the writer's staging buffer is the background worker's until then
            if parts.file_writer is not None:
                parts.file_writer.save(
                    state, path / save_filename, serialization=parts.settings.checkpoint_serialization
                )
            else:
                ds_comm.atomic_save(state, path / save_filename, serialization=parts.settings.checkpoint_serialization)
        _checkpoint.barrier()
        return True

    # -- load --------------------------------------------------------------------------------------------
    def load(
        self,
        load_dir: str | Path,
        tag: Any = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Callable[..., Any] | None = None,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """See `DeepSpeedEngine.load_checkpoint`.

        Everything is read and checked before the engine changes (nothing half loaded on a bad file).
        """
        parts, engine, mp_rank = self.parts, self.engine, self.parts.dist.mp_rank
        self.commit()  # a decoupled save still in flight is finished (and `latest` moved) before reading
        universal = parts.settings.load_universal
        ckpt_dir = _checkpoint.resolve_load_dir(load_dir, tag, universal=universal)
        if ckpt_dir is None:
            return None, None
        restore_optimizer = parts.zero.stage > 0 and load_optimizer_states and not load_module_only
        parts_read = None
        if universal:
            if parts.moe is not None and any(not layer.fused_experts for layer in parts.moe.layers):
                raise ValueError(
                    f"checkpoint.load_universal: {ckpt_dir} cannot be loaded into a model with MoE layers of "
                    "deepspeed.moe.layer.MoE (universal loading takes AutoEP layers); load the ZeRO checkpoint "
                    "itself, which re-partitions to this world size and ep_size"
                )
            path, state, parts_read, module_state = self._read_universal(ckpt_dir)
        else:
            path = _checkpoint.read_model_states(ckpt_dir, mp_rank, any_mp_rank=parts.tensor_parallel is not None)
            state = ds_comm.load_checkpoint_file(path)
            ds_comm.check_deepspeed_version(state.get("ds_version"), path)
            saved_tp = _checkpoint.saved_tp_degree(state)
            placeholders = _checkpoint.has_placeholders(state)
            if saved_tp != parts.dist.mp_world_size and restore_optimizer:
                # The module is saved whole; so is the optimizer state (`_tp_optimizer_state`), cut here.
                parts_read = self._tensor_parallel_partitions(ckpt_dir, state, path, saved_tp)
            elif placeholders or restore_optimizer:
                parts_read = _checkpoint.zero_partitions(ckpt_dir, mp_rank)
            module_state = _checkpoint.fill_placeholders(state, parts_read, path) if placeholders else state["module"]
        _moe_checkpoint.check_folded_file(state, parts.moe, path, family="dense")
        if parts.moe is not None and not universal and parts.zero.stage == 3:  # experts in the ZeRO partitions
            parts_read = parts_read if parts_read is not None else _checkpoint.zero_partitions(ckpt_dir, mp_rank)
            module_state = _moe_checkpoint.partitioned_expert_states(module_state, parts.moe, parts_read)
        elif parts.moe is not None and not universal:  # a universal load cut the experts for this rank already
            module_state = _moe_checkpoint.merge_expert_states(module_state, parts.moe, ckpt_dir, mp_rank=mp_rank)
        if parts.dist.global_rank == 0:
            _checkpoint.log_layout_change(
                state, path, dp_world_size=parts.dist.dp_world_size, sp_degree=parts.dist.sp_world_size
            )
        # DeepSpeed's call: the whole checkpoint dict (a subclass may override it), its module state filled in
        engine.load_module_state_dict({**state, "module": module_state}, load_module_strict, custom_load_fn)
        masters = parts_read if universal and parts.moe is not None else None  # see `_refresh_masters`
        if load_module_only:
            self._refresh_masters(masters)
        else:
            self._load_optimizer(state, ckpt_dir, load_optimizer_states, parts_read, masters)
            self.restore_progress(state, load_lr_scheduler_states=load_lr_scheduler_states)
        return str(path), {k: v for k, v in state.items() if k not in ENGINE_KEYS}

    def restore_progress(self, state: dict[str, Any], *, load_lr_scheduler_states: bool) -> None:
        """Counters, lr scheduler and this rank's RNG from a loaded model-states dict (both engines)."""
        engine, dist = self.engine, self.parts.dist
        if load_lr_scheduler_states and engine.lr_scheduler is not None and state.get("lr_scheduler") is not None:
            engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
        random_ltd = getattr(engine, "random_ltd_scheduler", None)
        if random_ltd is not None and state.get("random_ltd") is not None:
            random_ltd.load_state_dict(state["random_ltd"])
        counters = restored_counters(
            state,
            train_batch_size=engine.train_batch_size(),
            # ZenFlow's windows do not tile micro steps evenly (warm-up, reselections): keep the saved count
            gradient_accumulation_steps=1
            if getattr(engine, "zenflow", False)
            else engine.gradient_accumulation_steps(),
        )
        sampler = curriculum_sampler(engine)
        if sampler is not None and state.get("data_sampler") is not None:
            sampler.load_state_dict(state["data_sampler"])
        engine.global_steps = counters.global_steps
        engine.global_samples = counters.global_samples
        engine.skipped_steps = counters.skipped_steps
        engine.micro_steps = counters.micro_steps
        zenflow_resume_at = getattr(engine.optimizer, "zenflow_resume_at", None)
        if zenflow_resume_at is not None:  # ZenFlow's schedule follows the engine's micro-step count
            zenflow_resume_at(engine.micro_steps)
        rng = state.get("rng_states")
        if rng:
            if len(rng) == dist.world_size:
                set_rng_state(rng[dist.global_rank])
            else:
                logger.warning(
                    "checkpoint RNG states are for %d ranks, this run has %d; RNG not restored",
                    len(rng),
                    dist.world_size,
                )

    def _load_optimizer(
        self,
        state: dict[str, Any],
        ckpt_dir: Path,
        load_optimizer_states: bool,
        parts_read: list[dict[str, Any]] | None,
        masters: list[dict[str, Any]] | None,
    ) -> None:
        parts, stepper = self.parts, self.parts.stepper
        fp32 = parts.zero.load_from_fp32_weights
        mp_rank = parts.dist.mp_rank
        if stepper is None:
            return
        if not load_optimizer_states:
            self._refresh_masters(masters)
        elif parts.zero.stage > 0:
            _moe_checkpoint.check_folded_zero_file(ckpt_dir, parts.moe, dp_rank=parts.dist.dp_rank, mp_rank=mp_rank)
            stepper.load_partitions(  # type: ignore[attr-defined]  # ZeRO: a ZeroStepper
                parts_read if parts_read is not None else _checkpoint.zero_partitions(ckpt_dir, mp_rank),
                load_optimizer_states=True,
                load_from_fp32_weights=fp32,
            )
        elif parts.moe is not None:
            optimizer = _moe_checkpoint.read_stage0_optimizer(ckpt_dir, parts.moe, mp_rank=mp_rank)
            stepper.load_state_dict(optimizer, load_from_fp32_weights=fp32)
        elif state.get("optimizer") is not None:
            optimizer = state["optimizer"]
            tp = parts.tensor_parallel
            if tp is not None or _checkpoint.saved_tp_degree(state) > 1:  # saved whole: cut to this rank's shards
                params = stepper.state_params()  # type: ignore[attr-defined]  # every stage-0 stepper has it
                module = self.engine.module if tp is not None else None
                optimizer = _tp_optimizer_state.shard_stage0_state(optimizer, params, module)
            stepper.load_state_dict(optimizer, load_from_fp32_weights=fp32)
        else:
            logger.warning(
                "checkpoint %s has no stage-0 optimizer state (saved with ZeRO?); optimizer not restored", ckpt_dir
            )
            stepper.refresh_from_module()

    def _refresh_masters(self, universal_parts: list[dict[str, Any]] | None) -> None:
        """The fp32 masters without the optimizer state: from an AutoEP universal checkpoint's fp32 files (exact
        under bf16, as DeepSpeed's universal load), else from the module's weights."""
        stepper = self.parts.stepper
        if stepper is not None and universal_parts is not None:
            stepper.load_partitions(  # type: ignore[attr-defined]  # universal: ZeRO, a ZeroStepper
                universal_parts, load_optimizer_states=False, load_from_fp32_weights=True
            )
        elif stepper is not None:
            stepper.refresh_from_module()

    def _read_universal(self, ckpt_dir: Path) -> tuple[Path, dict[str, Any], list[dict[str, Any]], Any]:
        """A universal checkpoint's model states, its single-rank ZeRO partition and the module state_dict.

        The parameters come from the fp32 values in `zero/<name>/fp32.pt` (cast to the dtype the
        model-states file has them in), the buffers from the model-states file; AutoEP: `_universal_autoep`.
        """
        parts, module = self.parts, self.engine.module
        if parts.zero.stage == 0:
            raise ValueError(
                "checkpoint.load_universal needs ZeRO stage 1, 2 or 3 (a universal checkpoint holds the "
                "optimizer state per parameter, which only the ZeRO optimizers load); set zero_optimization.stage"
            )
        if parts.dist.mp_world_size > 1 and parts.tensor_parallel is None:
            raise ValueError(
                f"checkpoint.load_universal with a model-parallel unit ({parts.dist.mp_world_size} model-parallel "
                "ranks) is not supported: universal checkpoints load into AutoTP (tensor_parallel.autotp_size) and "
                "pipeline engines, not into models sliced by the client's mpu"
            )
        ds_zero = require("ds_zero", extra="zero", feature="loading a universal checkpoint")
        path = ds_zero.universal_model_states_file(ckpt_dir)
        state = ds_comm.load_checkpoint_file(path)
        ds_comm.check_deepspeed_version(state.get("ds_version"), path)
        if parts.moe is not None:  # AutoEP: each expert tensor cut for this expert-parallel rank
            read = _universal_autoep.read_autoep_universal(ckpt_dir, state, path, module, parts.stepper, parts.moe)
            return path, state, *read
        partitions = ds_zero.load_universal_partitions(ckpt_dir)
        full = ds_zero.consolidate_fp32_params(partitions)
        saved = state.get("module") or {}
        module_state = type(saved)((k, full[k].to(v.dtype) if k in full else v) for k, v in saved.items())
        if parts.tensor_parallel is not None and parts.stepper is not None:
            # Whole weights load through AutoTP (load_module_state_dict); the optimizer takes this rank's shards.
            shapes = ds_zero.zero_param_shapes(parts.stepper.optimizer, module)  # type: ignore[attr-defined]
            partitions = ds_zero.load_universal_partitions(
                ckpt_dir, param_shapes=shapes, transform=_universal_tp.shard_transform(module)
            )
        return path, state, partitions, module_state

    def _tensor_parallel_partitions(
        self, ckpt_dir: Path, state: dict[str, Any], path: Path, saved_tp: int
    ) -> list[dict[str, Any]]:
        """A ZeRO save at another tensor-parallel degree as a single-rank save of this rank's shards.

        The whole per-parameter state comes from the save's `optimizer_param_states` (tensor-parallel saves) or
        from its partitions (a TP=1 save); cut parameters are cut for this rank (`_tp_optimizer_state`).
        """
        ds_zero = require("ds_zero", extra="zero", feature="loading a ZeRO checkpoint")
        if saved_tp == 1:
            whole = ds_zero.param_states_from_partitions(_checkpoint.zero_partitions(ckpt_dir, 0))
        else:
            key = _tp_optimizer_state.PARAM_STATES_KEY
            whole = state.get(key)
            rank0_file = _checkpoint.model_file(ckpt_dir, 0)
            if whole is None and path != rank0_file and rank0_file.is_file():
                whole = ds_comm.load_checkpoint_file(rank0_file).get(key)
            if whole is None:
                raise ValueError(
                    f"load_checkpoint: {path} was saved with a tensor-parallel degree of {saved_tp}, this engine "
                    f"has {self.parts.dist.mp_world_size}, and holds no whole optimizer state ({key}: a ZeRO stage 3 "
                    "save, or one by an older ds): load it at its own tensor-parallel degree, or pass "
                    "load_module_only=True (or load_optimizer_states=False) to load the weights alone"
                )
        module = self.engine.module if self.parts.tensor_parallel is not None else None
        return ds_zero.partitions_from_param_states(_tp_optimizer_state.shard_param_states(whole, module))
