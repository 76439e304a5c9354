"""save_checkpoint / load_checkpoint / save_16bit_model: DeepSpeed's layout, written atomically.

Layout of `save_dir` (see the package README):
    latest                                          the last complete tag (no trailing newline)
    <tag>/mp_rank_00_model_states.pt                rank 0: module, counters, lr scheduler, RNG of every
                                                    rank, stage-0 optimizer (incl. loss scaler, fp32 masters)
    <tag>/zero_pp_rank_<r>_mp_rank_00_optim_states.pt   ZeRO >= 1 only: rank r's ds-zero partition

The engines capture what to save as a value (`_train_state.TrainState`, this rank's ZeRO
partition) and hand it over in a `SaveRequest`; `write_checkpoint` writes the files of both the
plain and the pipeline engine.

[Note: crash safety] Every file goes through `ds_comm.atomic_save` (a unique temporary name,
fsync, rename, fsync of the directory); all ranks finish their files before rank 0 switches
`latest`, so a save killed at any point leaves `latest` naming the previous complete tag
(`tests/dist/test_dist_checkpoint_kill.py` kills a save at every file-system step).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

import ds_comm
from ds_comm import atomic_save, atomic_write_text
from ds_engine.__about__ import __version__
from ds_engine._checkpoint import moe_checkpoint as _moe_checkpoint
from ds_engine._checkpoint import tp_optimizer_state as _tp_optimizer_state
from ds_engine._checkpoint import universal_tp as _universal_tp
from ds_engine._checkpoint.train_state import ENGINE_KEYS, TrainState, model_states, restored_counters, set_rng_state
from ds_engine._optional import require

if TYPE_CHECKING:
    from ds_engine._engine.engine import DeepSpeedEngine

logger = logging.getLogger(__name__)

__all__ = [
    "SaveRequest",
    "barrier",
    "gather_rng",
    "load_checkpoint",
    "model_file",
    "read_model_states",
    "resolve_save_tag",
    "restore_progress",
    "save_16bit_model",
    "write_checkpoint",
    "zero_file",
    "zero_partitions",
]


def model_file(ckpt_dir: Path, mp_rank: int) -> Path:
    """`<tag>/mp_rank_XX_model_states.pt`."""
    return ckpt_dir / f"mp_rank_{mp_rank:02d}_model_states.pt"


def zero_file(ckpt_dir: Path, dp_rank: int, mp_rank: int) -> Path:
    """`<tag>/zero_pp_rank_<dp>_mp_rank_XX_optim_states.pt`."""
    return ckpt_dir / f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


class CheckpointTagMismatchError(ds_comm.UsageError):
    """`save_checkpoint` got different tags on different ranks under `checkpoint.tag_validation: FAIL`
    (a ValueError, and the AssertionError DeepSpeed raises there: see `ds_comm.UsageError`)."""


def _check_tag(tag: str, *, mode: str, world_size: int, device: torch.device) -> None:
    if mode == "IGNORE" or world_size == 1 or not ds_comm.is_initialized():
        return
    digest = int.from_bytes(hashlib.sha1(tag.encode()).digest()[:7], "big")
    lo = torch.tensor([digest], dtype=torch.int64, device=device)
    hi = lo.clone()
    ds_comm.all_reduce(lo, op=ds_comm.ReduceOp.MIN)
    ds_comm.all_reduce(hi, op=ds_comm.ReduceOp.MAX)
    if lo.item() != hi.item():
        message = f"checkpoint tag {tag!r} differs across ranks (checkpoint.tag_validation={mode})"
        if mode == "FAIL":
            raise CheckpointTagMismatchError(message + "; pass the same tag on every rank")
        logger.warning(message)


def _all_gather_pickled(obj: Any, world_size: int, device: torch.device) -> list[Any]:
    """Every rank's `obj`, in rank order, through two tensor all-gathers.

    [Note: why not all_gather_object] torch's object collectives decode through numpy, which is
    not a torch dependency; this path needs only tensors (on `device`, so it works on nccl too).
    """
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world_size)]
    ds_comm.all_gather(sizes, size)
    longest = max(int(n) for n in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    gathered = [torch.zeros_like(padded) for _ in range(world_size)]
    ds_comm.all_gather(gathered, padded)
    return [pickle.loads(bytes(g[: int(n)].cpu().tolist())) for g, n in zip(gathered, sizes, strict=True)]


def gather_rng(state: dict[str, Any], *, world_size: int, device: torch.device) -> list[dict[str, Any]]:
    """Every rank's RNG `state` in global rank order (a collective over the world when it has several ranks)."""
    if world_size == 1 or not ds_comm.is_initialized():
        return [state]
    return _all_gather_pickled(state, world_size, device)


def resolve_save_tag(
    save_dir: str | Path, tag: Any, *, global_steps: int, tag_validation: str, world_size: int, device: torch.device
) -> str:
    """The tag to save under (default `global_step<N>`), checked to be a plain name every rank agrees on."""
    if not save_dir:
        raise ValueError(f"save_checkpoint: save_dir must be a directory path, got {save_dir!r}")
    tag = f"global_step{global_steps}" if tag is None else str(tag)
    if not tag or "/" in tag or tag in (".", ".."):
        raise ValueError(f"save_checkpoint: tag must be a plain directory name, got {tag!r}")
    _check_tag(tag, mode=tag_validation, world_size=world_size, device=device)
    return tag


@dataclasses.dataclass(frozen=True, kw_only=True)
class SaveRequest:
    """One rank's part of a checkpoint save: where, what, and which files this rank writes."""

    root: Path
    """The save directory (holds `latest` and the tag directories)."""
    tag: str
    mp_rank: int
    dp_rank: int
    writes_latest: bool
    """This rank switches `latest` (global rank 0)."""
    serialization: bool
    """torch's zipfile format (`checkpoint.checkpoint_serialization`)."""
    ds_config: dict[str, Any]
    train_state: TrainState | None
    """The model-states content; given on data-parallel rank 0 only (the rank that writes it)."""
    zero_partition: dict[str, Any] | None
    """Under ZeRO: this rank's optimizer partition (its stepper's state_dict)."""
    client_state: dict[str, Any]
    save_latest: bool
    write_weights: Callable[[Path], None] | None = None
    """Writes weights kept outside the model-states file into the tag directory (a pipeline's layer files)."""
    ds_version: str = __version__
    """The `ds_version` the model-states file carries (DeepSpeed's release for a DeepSpeed-layout save)."""


def write_checkpoint(request: SaveRequest) -> Path:
    """Write this rank's files of a checkpoint, then (rank 0, after every rank finished) `latest`.

    Collective: every rank calls it (two barriers on the world). Every file goes through
    `ds_comm.atomic_save`, so a save killed at any point leaves `latest` on the previous complete tag.

    Returns:
        The tag directory.
    """
    ckpt_dir = request.root / request.tag
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    if request.write_weights is not None:
        request.write_weights(ckpt_dir)
    if request.train_state is not None:
        state = model_states(request.train_state, request.client_state, ds_version=request.ds_version)
        atomic_save(state, model_file(ckpt_dir, request.mp_rank), serialization=request.serialization)
    if request.zero_partition is not None:
        partition = {
            "optimizer_state_dict": request.zero_partition,
            "ds_config": request.ds_config,
            "ds_version": __version__,
        }
        atomic_save(
            partition, zero_file(ckpt_dir, request.dp_rank, request.mp_rank), serialization=request.serialization
        )
    if request.zero_partition is not None and request.writes_latest:
        # DeepSpeed copies its consolidation scripts next to ZeRO checkpoints; these are ds's (torch only).
        require("ds_zero", extra="zero", feature="ZeRO checkpoints").copy_recovery_scripts(request.root)
    barrier()
    if request.save_latest and request.writes_latest:
        atomic_write_text(request.root / "latest", request.tag)
    barrier()
    logger.info("saved checkpoint %s", ckpt_dir)
    return ckpt_dir


def barrier() -> None:
    if ds_comm.is_initialized() and ds_comm.get_world_size() > 1:
        ds_comm.barrier()


def zero_partitions(ckpt_dir: Path, mp_rank: int) -> list[dict[str, Any]]:
    """Every rank's ZeRO partition of `mp_rank` (ds's or DeepSpeed's files), read and checked in full."""
    ds_zero = require("ds_zero", extra="zero", feature="loading a ZeRO checkpoint")
    return ds_zero.load_partition_state_dicts(ckpt_dir, mp_rank=mp_rank)


def _load_optimizer(
    engine: DeepSpeedEngine,
    state: dict[str, Any],
    ckpt_dir: Path,
    load_optimizer_states: bool,
    parts: list[dict[str, Any]] | None,
) -> None:
    fp32 = engine._zero.load_from_fp32_weights
    if engine._stepper is None:
        return
    if not load_optimizer_states:
        engine._stepper.refresh_from_module()
    elif engine._zero.stage > 0:
        engine._stepper.load_partitions(
            parts if parts is not None else zero_partitions(ckpt_dir, engine._mp_rank),
            load_optimizer_states=True,
            load_from_fp32_weights=fp32,
        )
    elif engine._moe is not None:
        optimizer = _moe_checkpoint.read_stage0_optimizer(ckpt_dir, engine._moe, mp_rank=engine._mp_rank)
        engine._stepper.load_state_dict(optimizer, load_from_fp32_weights=fp32)
    elif state.get("optimizer") is not None:
        optimizer = state["optimizer"]
        if engine._tp is not None or _saved_tp(state) > 1:  # saved whole: cut to this rank's shards
            params = engine._stepper.state_params()  # type: ignore[attr-defined]  # every stage-0 stepper has it
            module = engine.module if engine._tp is not None else None
            optimizer = _tp_optimizer_state.shard_stage0_state(optimizer, params, module)
        engine._stepper.load_state_dict(optimizer, load_from_fp32_weights=fp32)
    else:
        logger.warning(
            "checkpoint %s has no stage-0 optimizer state (saved with ZeRO?); optimizer not restored", ckpt_dir
        )
        engine._stepper.refresh_from_module()


def restore_progress(engine: DeepSpeedEngine, state: dict[str, Any], *, load_lr_scheduler_states: bool) -> None:
    """Counters, lr scheduler and this rank's RNG from a loaded model-states dict (both engines)."""
    if load_lr_scheduler_states and engine.lr_scheduler is not None and state.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    counters = restored_counters(
        state,
        train_batch_size=engine.train_batch_size(),
        gradient_accumulation_steps=engine.gradient_accumulation_steps(),
    )
    engine.global_steps = counters.global_steps
    engine.global_samples = counters.global_samples
    engine.skipped_steps = counters.skipped_steps
    engine.micro_steps = counters.micro_steps
    rng = state.get("rng_states")
    if rng:
        if len(rng) == engine.world_size:
            set_rng_state(rng[engine.global_rank])
        else:
            logger.warning(
                "checkpoint RNG states are for %d ranks, this run has %d; RNG not restored", len(rng), engine.world_size
            )


def _log_layout_change(state: dict[str, Any], path: Path, *, dp_world_size: int, sp_degree: int) -> None:
    """Say when the save came from another data x sequence layout; it loads all the same.

    ZeRO partitions over data x sequence ranks, so a save holds `dp_world_size` (= replicas x sp)
    partitions, and ds-zero re-partitions them onto this run's ranks whatever their split (DeepSpeed
    refuses a different count). Saves without `sp_degree` (DeepSpeed's, older ds) leave it unknown.
    """
    saved_dp = state.get("dp_world_size")
    dims = state.get("checkpoint_parallel_dimensions")
    saved_sp = dims.get("sp_degree") if isinstance(dims, dict) else None
    if saved_dp is None or (int(saved_dp) == dp_world_size and saved_sp in (None, sp_degree)):
        return
    logger.info(
        "load_checkpoint: %s was saved on %s data x sequence ranks (sp_degree %s), this run has %d "
        "(sp_degree %d); ZeRO state re-partitions onto this layout",
        path,
        saved_dp,
        "unrecorded" if saved_sp is None else saved_sp,
        dp_world_size,
        sp_degree,
    )


def resolve_load_dir(load_dir: str | Path, tag: Any, *, universal: bool = False) -> Path | None:
    """`load_dir/<tag>`, the tag defaulting to the one in `load_dir/latest`; None (with a warning, as
    DeepSpeed does) when no tag is given and there is no `latest` file.

    `universal` (`checkpoint.load_universal`): the tag comes from `load_dir/latest_universal`, which
    must exist (ValueError otherwise, as in DeepSpeed).
    """
    root = Path(load_dir)
    if tag is None:
        latest = root / ("latest_universal" if universal else "latest")
        if not latest.is_file():
            if universal:
                raise ValueError(
                    f"load_checkpoint: checkpoint.load_universal is set and {latest} does not exist; "
                    "ds_to_universal writes it next to its --output_folder (or pass tag=)"
                )
            logger.warning("load_checkpoint: no 'latest' file in %s; nothing loaded (pass tag= to pick one)", root)
            return None
        tag = latest.read_text().strip()
    return root / str(tag)


def _read_universal(engine: DeepSpeedEngine, ckpt_dir: Path) -> tuple[Path, dict[str, Any], list[dict[str, Any]], Any]:
    """A universal checkpoint's model states, its single-rank ZeRO partition and the module state_dict.

    The parameters come from the fp32 values in `zero/<name>/fp32.pt` (cast to the dtype the
    model-states file has them in), the buffers from the model-states file.
    """
    if engine._zero.stage == 0:
        raise ValueError(
            "checkpoint.load_universal needs ZeRO stage 1, 2 or 3 (a universal checkpoint holds the "
            "optimizer state per parameter, which only the ZeRO optimizers load); set zero_optimization.stage"
        )
    if engine.mp_world_size > 1 and engine._tp is None:
        raise ValueError(
            f"checkpoint.load_universal with a model-parallel unit ({engine.mp_world_size} model-parallel ranks) "
            "is not supported: universal checkpoints load into AutoTP (tensor_parallel.autotp_size) and "
            "pipeline engines, not into models sliced by the client's mpu"
        )
    ds_zero = require("ds_zero", extra="zero", feature="loading a universal checkpoint")
    path = ds_zero.universal_model_states_file(ckpt_dir)
    state = ds_comm.load_checkpoint_file(path)
    ds_comm.check_deepspeed_version(state.get("ds_version"), path)
    parts = ds_zero.load_universal_partitions(ckpt_dir)
    full = ds_zero.consolidate_fp32_params(parts)
    module = state.get("module") or {}
    module_state = type(module)((k, full[k].to(v.dtype) if k in full else v) for k, v in module.items())
    if engine._tp is not None and engine._stepper is not None:
        # Whole weights load through AutoTP (load_module_state_dict); the optimizer takes this rank's shards.
        shapes = ds_zero.zero_param_shapes(engine._stepper.optimizer, engine.module)
        parts = ds_zero.load_universal_partitions(
            ckpt_dir, param_shapes=shapes, transform=_universal_tp.shard_transform(engine.module)
        )
    return path, state, parts, module_state


def load_checkpoint(
    engine: DeepSpeedEngine,
    load_dir: str | Path,
    tag: Any = None,
    load_module_strict: bool = True,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
    custom_load_fn: Any = None,
) -> tuple[str | None, dict[str, Any] | None]:
    """See `DeepSpeedEngine.load_checkpoint`."""
    universal = engine._ckpt_config.load_universal
    ckpt_dir = resolve_load_dir(load_dir, tag, universal=universal)
    if ckpt_dir is None:
        return None, None
    # Everything is read and checked before the engine changes (nothing half loaded on a bad file).
    parts = None
    if universal:
        if engine._moe is not None:
            raise ValueError(
                f"checkpoint.load_universal: {ckpt_dir} cannot be loaded into a model with MoE layers "
                "(universal checkpoints hold no per-expert files here); load the ZeRO checkpoint itself, "
                "which re-partitions to this world size and ep_size"
            )
        path, state, parts, module_state = _read_universal(engine, ckpt_dir)
    else:
        path = read_model_states(ckpt_dir, engine._mp_rank, any_mp_rank=engine._tp is not None)
        state = ds_comm.load_checkpoint_file(path)
        ds_comm.check_deepspeed_version(state.get("ds_version"), path)
        saved_tp = _saved_tp(state)
        tp = 1 if engine.pipeline_parallelism else engine.mp_world_size
        if saved_tp != tp and engine._zero.stage > 0 and load_optimizer_states and not load_module_only:
            # The module is saved whole; so is the optimizer state (`_tp_optimizer_state`), cut here.
            parts = _tensor_parallel_partitions(engine, ckpt_dir, state, path, saved_tp)
        elif _has_placeholders(state) or (engine._zero.stage > 0 and load_optimizer_states and not load_module_only):
            parts = zero_partitions(ckpt_dir, engine._mp_rank)
        placeholders = _has_placeholders(state)
        module_state = _fill_placeholders(state, parts, path) if placeholders else state["module"]
    if engine._moe is not None:
        module_state = _moe_checkpoint.merge_expert_states(module_state, engine._moe, ckpt_dir, mp_rank=engine._mp_rank)
    if engine.global_rank == 0:
        _log_layout_change(state, path, dp_world_size=engine.dp_world_size, sp_degree=engine._dist.sp_world_size)
    if custom_load_fn is not None:
        custom_load_fn(src=module_state, dst=engine.module)
    else:
        engine.load_module_state_dict(module_state, strict=load_module_strict)
    if load_module_only:
        if engine._stepper is not None:
            engine._stepper.refresh_from_module()
    else:
        _load_optimizer(engine, state, ckpt_dir, load_optimizer_states, parts)
        restore_progress(engine, state, load_lr_scheduler_states=load_lr_scheduler_states)
    client_state = {k: v for k, v in state.items() if k not in ENGINE_KEYS}
    return str(path), client_state


def _saved_tp(state: dict[str, Any]) -> int:
    return int((state.get("checkpoint_parallel_dimensions") or {}).get("tp_degree", 1) or 1)


def _tensor_parallel_partitions(
    engine: DeepSpeedEngine, ckpt_dir: Path, state: dict[str, Any], path: Path, saved_tp: int
) -> list[dict[str, Any]]:
    """A ZeRO save at another tensor-parallel degree as a single-rank save of this rank's shards.

    The whole per-parameter state comes from the save's `optimizer_param_states` (tensor-parallel saves) or
    from its partitions (a TP=1 save); cut parameters are cut for this rank (`_tp_optimizer_state`).
    """
    ds_zero = require("ds_zero", extra="zero", feature="loading a ZeRO checkpoint")
    if saved_tp == 1:
        whole = ds_zero.param_states_from_partitions(zero_partitions(ckpt_dir, 0))
    else:
        key = _tp_optimizer_state.PARAM_STATES_KEY
        whole = state.get(key)
        if whole is None and path != model_file(ckpt_dir, 0) and model_file(ckpt_dir, 0).is_file():
            whole = ds_comm.load_checkpoint_file(model_file(ckpt_dir, 0)).get(key)
        if whole is None:
            raise ValueError(
                f"load_checkpoint: {path} was saved with a tensor-parallel degree of {saved_tp}, this engine has "
                f"{1 if engine.pipeline_parallelism else engine.mp_world_size}, and holds no whole optimizer state "
                f"({key}: a ZeRO stage 3 save, or one by an older ds): load it at its own tensor-parallel degree, or "
                "pass load_module_only=True (or load_optimizer_states=False) to load the weights alone"
            )
    mine = _tp_optimizer_state.shard_param_states(whole, engine.module if engine._tp is not None else None)
    return ds_zero.partitions_from_param_states(mine)


def read_model_states(ckpt_dir: Path, mp_rank: int, *, any_mp_rank: bool = False) -> Path:
    """The model-states file of `mp_rank`: ds's `mp_rank_XX_model_states.pt`, or DeepSpeed's stage-3 name.

    DeepSpeed's stage 3 has every data-parallel rank write `zero_pp_rank_{dp}_mp_rank_XX_model_states.pt`;
    they differ only in bookkeeping, so data-parallel rank 0's serves any world size. `any_mp_rank`
    (tensor parallelism, whose files all hold the whole model): without a file of `mp_rank`, mp rank 0's
    (a save at a lower degree).
    """
    candidates = [model_file(ckpt_dir, mp_rank), ckpt_dir / f"zero_pp_rank_0_mp_rank_{mp_rank:02d}_model_states.pt"]
    if any_mp_rank:
        candidates.append(model_file(ckpt_dir, 0))
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"load_checkpoint: {model_file(ckpt_dir, mp_rank)} does not exist (nor DeepSpeed's stage-3 "
        f"zero_pp_rank_0_mp_rank_{mp_rank:02d}_model_states.pt); is {ckpt_dir} a checkpoint tag directory?"
    )


def _has_placeholders(state: dict[str, Any]) -> bool:
    """DeepSpeed's stage-3 model states hold an empty tensor for every partitioned parameter."""
    shapes = {name: shape for group in state.get("param_shapes") or [] for name, shape in group.items()}
    module = state.get("module") or {}
    return any(
        isinstance(module.get(name), torch.Tensor) and module[name].numel() == 0 and math.prod(shape) > 0
        for name, shape in shapes.items()
    )


def _fill_placeholders(state: dict[str, Any], parts: list[dict[str, Any]] | None, path: Path) -> dict[str, Any]:
    """The module state_dict with each stage-3 placeholder replaced by its value: trainable parameters rebuilt
    from the partitions, frozen ones from every rank's `frozen_param_fragments`, tied names from `shared_params`
    (`ds_zero`'s model-states note)."""
    ds_zero = require("ds_zero", extra="zero", feature="loading a ZeRO stage-3 checkpoint")
    module = state["module"]
    full = ds_zero.consolidate_fp32_params(parts or [])
    if state.get("frozen_param_fragments"):
        full.update(ds_zero.read_frozen_params(path.parent, _mp_rank_of(path)))
    full = ds_zero.with_shared(full, state.get("shared_params"))
    out = dict(module)
    for name, value in module.items():
        if isinstance(value, torch.Tensor) and value.numel() == 0 and name in full:
            out[name] = full[name].to(value.dtype)
    missing = [n for n, v in out.items() if isinstance(v, torch.Tensor) and v.numel() == 0 and n not in full]
    if missing:
        raise ValueError(
            f"{path}: parameters {missing[:5]} are empty placeholders, in no optimizer partition and in no "
            "frozen_param_fragments of the model-states files"
        )
    return out


def _mp_rank_of(path: Path) -> int:
    """The model-parallel rank in a model-states file's name (`..._mp_rank_XX_model_states.pt`)."""
    return int(path.name.removesuffix("_model_states.pt").rsplit("mp_rank_", 1)[1])


def save_16bit_model(
    engine: DeepSpeedEngine,
    save_dir: str | Path,
    save_filename: str = "pytorch_model.bin",
    exclude_frozen_parameters: bool = False,
) -> bool:
    """See `DeepSpeedEngine.save_16bit_model`.

    At stage 3 the full weights are assembled by `ds_zero.consolidated_16bit_state_dict`, which gathers
    one module's parameters at a time (the whole model is never gathered at once on any rank) and
    copies them to the CPU on rank 0. Without `stage3_gather_16bit_weights_on_model_save` nothing is
    written and False is returned (DeepSpeed does the same: the partitioned state_dict would be bogus).
    """
    if engine._zero.stage == 3:
        if not engine._zero.gather_16bit_weights_on_model_save:
            logger.warning(
                "save_16bit_model: nothing saved; under ZeRO stage 3 the parameters are partitioned, set "
                "zero_optimization.stage3_gather_16bit_weights_on_model_save=true to gather and save them"
            )
            return False
        ds_zero = require("ds_zero", extra="zero", feature="ZeRO stage 3 save_16bit_model")
        state = ds_zero.consolidated_16bit_state_dict(
            engine.module, rank0_only=True, exclude_frozen_parameters=exclude_frozen_parameters
        )
    elif engine._tp is not None:  # whole weights are gathered in every tensor-parallel group (a collective)
        state = engine.module_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
    else:
        state = (
            engine.module_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
            if engine.global_rank == 0
            else {}
        )
    if engine.global_rank == 0:
        path = Path(save_dir)
        path.mkdir(parents=True, exist_ok=True)
        atomic_save(state, path / save_filename, serialization=engine._ckpt_config.checkpoint_serialization)
    barrier()
    return True
