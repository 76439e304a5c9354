"""`checkpoint.layout: "deepspeed"`: save_checkpoint writes the files DeepSpeed 0.19.8 writes and loads.

How a save goes (every rank calls it; the file system is shared, as for any ds save):

1. Global rank 0 removes any `save_dir/.<tag>.deepspeed-staging/` (left by saves that failed), then a barrier.
2. Every rank writes its ds files there (`_checkpoint.write_checkpoint`, so the same atomic writes):
   under ZeRO as the tag `ds-layout`, a pipeline's layer files straight into `deepspeed-layout/` (ds
   writes DeepSpeed's layer files); without ZeRO ds's files already are DeepSpeed's and go to
   `deepspeed-layout/` with DeepSpeed's `ds_version`.
3. Under ZeRO each rank writes its own DeepSpeed files into `deepspeed-layout/` from the staged ds save
   (`ds_zero.write_deepspeed_files`, partitions read memory-mapped: a rank reads the fragments it needs):
   its `[bf16_]zero_pp_rank_{dp}_..._optim_states.pt`, and the model-states file on data-parallel rank 0
   (every rank at stage 3, as DeepSpeed does). Then a barrier.
4. Global rank 0 publishes: `deepspeed-layout/` becomes `save_dir/<tag>` with one rename (an existing tag
   directory is swapped out atomically where the kernel can, `_dir_swap`), then the recovery scripts,
   then `latest`, then the staging directory is removed. A barrier ends the save.

With `checkpoint.writer.decoupled` steps 1-2 happen at the save (the files queued to the background writer)
and steps 3-4 at its commit, once every rank's staged files are written (`stage_deepspeed_checkpoint`).

[Note: crash safety] Until the rename in step 4 nothing outside the staging directory has changed, so a
save that fails or dies at any point before it leaves `save_dir` as the last good save left it, and
`latest` moves only after the tag directory is complete, as for a ds-layout save.

What DeepSpeed's layout cannot hold is refused at initialize() when asked for (`check_deepspeed_layout`):
NVMe-offloaded state (DeepSpeed keeps it in swap files beside the checkpoint; not written here), MoE expert
files (not written here), tensor parallelism (ds saves such models whole, DeepSpeed per slice), sequence
parallelism (not written here: DeepSpeed's files for it have not been checked against ds's), and pipelines with
ZeRO 2/3 (DeepSpeed's pipeline engine takes ZeRO 0/1). Where the layout is only the default (`checkpoint.layout`
unset under the `deepspeed` distribution), such a job falls back to ds's layout, logged once
(`resolve_checkpoint_layout`).
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ds_comm import atomic_write_text
from ds_comm.checkpoint_files import DEEPSPEED_READ_VERSION
from ds_engine._checkpoint import checkpoint as _checkpoint
from ds_engine._checkpoint.dir_swap import publish_dir
from ds_engine._optional import require
from ds_engine.config import DeepSpeedConfigError, default_checkpoint_layout

if TYPE_CHECKING:
    from ds_engine.config import DeepSpeedConfig

logger = logging.getLogger(__name__)

__all__ = [
    "DEEPSPEED_VERSION",
    "check_deepspeed_layout",
    "check_deepspeed_layout_moe",
    "resolve_checkpoint_layout",
    "write_deepspeed_checkpoint",
]

#: The `ds_version` DeepSpeed-layout files carry (the DeepSpeed release whose layout they follow).
DEEPSPEED_VERSION = ".".join(map(str, DEEPSPEED_READ_VERSION))
_KEY = 'checkpoint.layout="deepspeed"'
_STAGING_SUFFIX = ".deepspeed-staging"
_STAGED, _BUILT = "ds-layout", "deepspeed-layout"  # the staging directory's ds save and DeepSpeed tag directory


def _refuse(feature: str, fix: str) -> DeepSpeedConfigError:
    return DeepSpeedConfigError(f'{_KEY} cannot be written with {feature}; {fix}, or use checkpoint.layout="ds"')


def _unsupported(
    config: DeepSpeedConfig, *, pipeline: bool, tp_size: int, mp_world_size: int, sp_size: int, has_moe: bool
) -> tuple[str, str] | None:
    """(the feature, the fix) when DeepSpeed's layout cannot hold this job's checkpoint; None when it can."""
    zero = config.zero
    for key, device in (
        ("offload_param", zero.offload_param_device),
        ("offload_optimizer", zero.offload_optimizer_device),
    ):
        if device == "nvme":
            return (
                f"NVMe offload (zero_optimization.{key}.device='nvme': DeepSpeed saves that state from its swap files)",
                "offload to 'cpu'",
            )
    if pipeline and zero.stage > 1:
        return (
            f"a pipeline at ZeRO stage {zero.stage} (DeepSpeed's PipelineEngine takes ZeRO stage 0 or 1)",
            "use zero_optimization.stage 0 or 1",
        )
    if tp_size > 1 or (mp_world_size > 1 and not pipeline):
        return (
            f"tensor (model) parallelism ({mp_world_size} model-parallel ranks; ds saves the model whole)",
            "save without it",
        )
    if sp_size > 1:
        return f"sequence parallelism (sequence_parallel_size={sp_size})", "save without it"
    if has_moe:
        return "MoE layers (expert files and expert-parallel optimizer files)", "train without MoE layers"
    return None


def check_deepspeed_layout(
    config: DeepSpeedConfig,
    *,
    pipeline: bool,
    tp_size: int,
    mp_world_size: int,
    sp_size: int,
    has_moe: bool = False,
) -> None:
    """Refuse, before any work, an explicit `checkpoint.layout: "deepspeed"` that cannot hold the job's
    checkpoint (no-op for any other value).

    Raises:
        DeepSpeedConfigError: names `checkpoint.layout` and the feature.
    """
    if config.parsed.checkpoint.layout != "deepspeed":
        return
    reason = _unsupported(
        config, pipeline=pipeline, tp_size=tp_size, mp_world_size=mp_world_size, sp_size=sp_size, has_moe=has_moe
    )
    if reason is not None:
        raise _refuse(*reason)


def resolve_checkpoint_layout(
    config: DeepSpeedConfig,
    *,
    pipeline: bool,
    tp_size: int,
    mp_world_size: int,
    sp_size: int,
    has_moe: bool,
    rank: int,
) -> DeepSpeedConfig:
    """`config` with `checkpoint.layout` decided, once, in `initialize()`.

    An explicit value stands (DeepSpeed's is refused where it cannot hold the job: `check_deepspeed_layout`).
    Unset, it is the process default (`ds_engine.config.default_checkpoint_layout`: ds's, or DeepSpeed's
    under the `deepspeed` distribution); where the default is DeepSpeed's and that layout cannot hold the
    job, ds's layout is written instead, and global rank `rank` 0 says so and why (a warning: DeepSpeed's
    tools do not read ds's layout; ds's `zero_to_fp32.py` in the save directory does).

    Raises:
        DeepSpeedConfigError: an explicit "deepspeed" that cannot hold the job.
    """
    kwargs: dict[str, Any] = {
        "pipeline": pipeline,
        "tp_size": tp_size,
        "mp_world_size": mp_world_size,
        "sp_size": sp_size,
    }
    check_deepspeed_layout(config, **kwargs, has_moe=has_moe)
    if config.parsed.checkpoint.layout is not None:
        return config
    layout = default_checkpoint_layout()
    reason = _unsupported(config, **kwargs, has_moe=has_moe) if layout == "deepspeed" else None
    if reason is not None:
        layout = "ds"
        if rank == 0:
            logger.warning(
                "checkpoints are saved in ds's layout, not DeepSpeed's (the default under `import deepspeed`): "
                "DeepSpeed's layout cannot hold %s. ds loads them, and the zero_to_fp32.py ds writes next to "
                'them consolidates them; set checkpoint.layout="ds" to silence this',
                reason[0],
            )
    elif rank == 0 and layout == "deepspeed":
        logger.info("checkpoints are saved in DeepSpeed's layout (checkpoint.layout unset under `import deepspeed`)")
    return config.with_checkpoint_layout(layout)


def check_deepspeed_layout_moe(config: DeepSpeedConfig, *, has_moe: bool) -> None:
    """Refuse MoE models (their expert files are not written in DeepSpeed's layout here)."""
    if has_moe and config.parsed.checkpoint.layout == "deepspeed":
        raise _refuse("MoE layers (expert files and expert-parallel optimizer files)", "train without MoE layers")


def write_deepspeed_checkpoint(request: _checkpoint.SaveRequest) -> Path:
    """Write this rank's part of a DeepSpeed-layout checkpoint (the module docstring has the steps).

    Collective: every rank calls it (five barriers on the world).

    Returns:
        The published tag directory.
    """
    return stage_deepspeed_checkpoint(request)()


def stage_deepspeed_checkpoint(request: _checkpoint.SaveRequest) -> Callable[[], Path]:
    """Steps 1-2: this rank's ds files into the staging directory (through `request.file_writer`, which may
    queue them: `checkpoint.writer.decoupled`). Returns steps 3-4, to call once those files are written
    (collective: under ZeRO it builds DeepSpeed's files from them, then publishes the tag and `latest`)."""
    root, tag = request.root, request.tag
    staging = root / f".{tag}{_STAGING_SUFFIX}"
    out = staging / _BUILT  # becomes save_dir/<tag>; its own name never meets a user's tag
    if request.writes_latest:
        for stale in root.glob(f".*{_STAGING_SUFFIX}") if root.is_dir() else []:
            logger.info("removing %s, left by a save that did not finish", stale)
            shutil.rmtree(stale)
    _checkpoint.barrier()
    zero = request.zero_partition is not None
    weights = request.write_weights
    if zero:
        out.mkdir(parents=True, exist_ok=True)
        staged = dataclasses.replace(
            request,
            root=staging,
            tag=_STAGED,
            writes_latest=False,
            save_latest=False,
            write_weights=(lambda _: weights(out)) if weights is not None else None,
        )
        src = _checkpoint.write_checkpoint(staged)
    else:  # without ZeRO partitions ds's files are DeepSpeed's
        _checkpoint.write_checkpoint(
            dataclasses.replace(
                request,
                root=staging,
                tag=_BUILT,
                writes_latest=False,
                save_latest=False,
                ds_version=DEEPSPEED_VERSION,
            )
        )

    def finish() -> Path:
        ds_zero = require("ds_zero", extra="zero", feature="a DeepSpeed-layout ZeRO checkpoint") if zero else None
        if ds_zero is not None:
            ds_zero.write_deepspeed_files(
                src,
                out,
                mp_rank=request.mp_rank,
                dp_ranks=[request.dp_rank],
                serialization=request.serialization,
                mmap=request.serialization,  # torch maps zipfile checkpoints only
            )
        _checkpoint.barrier()
        target = root / tag
        if request.writes_latest:
            publish_dir(out, target)
            if ds_zero is not None:
                ds_zero.copy_recovery_scripts(root)
            if request.save_latest:
                atomic_write_text(root / "latest", tag)
            shutil.rmtree(staging)
        _checkpoint.barrier()
        logger.info("saved checkpoint %s (DeepSpeed's layout)", target)
        return target

    return finish
