"""Checkpoint files: DeepSpeed's layout, written atomically, and the readers that need no engine.

Layout of `save_dir` (see the package README):
    latest                                          the last complete tag (no trailing newline)
    <tag>/mp_rank_00_model_states.pt                rank 0: module, counters, lr scheduler, RNG of every
                                                    rank, stage-0 optimizer (incl. loss scaler, fp32 masters)
    <tag>/zero_pp_rank_<r>_mp_rank_00_optim_states.pt   ZeRO >= 1 only: rank r's ds-zero partition

An engine's `Checkpointer` (`_checkpoint.checkpointer`) captures what to save as a value
(`_train_state.TrainState`, this rank's ZeRO partition) and hands it over in a `SaveRequest`;
`write_checkpoint` writes the files of both the plain and the pipeline engine.

[Note: crash safety] Every file goes through `ds_comm.atomic_save`, or the `checkpoint.writer`'s
`CheckpointFileWriter` built on the same `atomic_write` (a unique temporary name, fsync, rename,
fsync of the directory); all ranks finish their files before rank 0 switches
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
from typing import Any

import torch

import ds_comm
from ds_comm import atomic_save, atomic_write_text
from ds_engine.__about__ import __version__
from ds_engine._checkpoint.decoupled import DecoupledWriter
from ds_engine._checkpoint.file_writer import CheckpointFileWriter
from ds_engine._checkpoint.train_state import TrainState, model_states
from ds_engine._optional import require

logger = logging.getLogger(__name__)

__all__ = [
    "CheckpointTagMismatchError",
    "SaveRequest",
    "barrier",
    "fill_placeholders",
    "gather_rng",
    "has_placeholders",
    "log_layout_change",
    "model_file",
    "read_model_states",
    "resolve_load_dir",
    "resolve_save_tag",
    "saved_tp_degree",
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
    file_writer: CheckpointFileWriter | DecoupledWriter | None = None
    """How files are written (`checkpoint.writer`; a `DecoupledWriter` queues them); None: `ds_comm.atomic_save`."""
    zero_partition_extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Entries the ZeRO optimizer file carries beside the partition (a folded AutoEP run's `folding` record)."""
    replica_model_states: bool = False
    """Every data-parallel rank holds `train_state` and writes its share of the model-states file
    (`checkpoint.writer.data_parallel: replica`, see `_checkpoint.file_writer`)."""


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
    save = request.file_writer.save if request.file_writer is not None else atomic_save
    if request.train_state is not None:
        state = model_states(request.train_state, request.client_state, ds_version=request.ds_version)
        if request.replica_model_states and isinstance(request.file_writer, CheckpointFileWriter):
            request.file_writer.save_replicated(
                state, model_file(ckpt_dir, request.mp_rank), serialization=request.serialization
            )
        else:
            save(state, model_file(ckpt_dir, request.mp_rank), serialization=request.serialization)
    if request.zero_partition is not None:
        partition = {
            "optimizer_state_dict": request.zero_partition,
            "ds_config": request.ds_config,
            "ds_version": __version__,
            **request.zero_partition_extra,
        }
        save(partition, zero_file(ckpt_dir, request.dp_rank, request.mp_rank), serialization=request.serialization)
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


def log_layout_change(state: dict[str, Any], path: Path, *, dp_world_size: int, sp_degree: int) -> None:
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


def saved_tp_degree(state: dict[str, Any]) -> int:
    return int((state.get("checkpoint_parallel_dimensions") or {}).get("tp_degree", 1) or 1)


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


def has_placeholders(state: dict[str, Any]) -> bool:
    """DeepSpeed's stage-3 model states hold an empty tensor for every partitioned parameter."""
    shapes = {name: shape for group in state.get("param_shapes") or [] for name, shape in group.items()}
    module = state.get("module") or {}
    return any(
        isinstance(module.get(name), torch.Tensor) and module[name].numel() == 0 and math.prod(shape) > 0
        for name, shape in shapes.items()
    )


def fill_placeholders(state: dict[str, Any], parts: list[dict[str, Any]] | None, path: Path) -> dict[str, Any]:
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
