"""DeepSpeedEngine's checkpoint file-name methods (`_get_ckpt_name`, `_get_zero_ckpt_name`, `_get_expert_ckpt_name`,
`_get_optimizer_ckpt_name`), and the small checkpoint methods beside `save_checkpoint` (`commit_checkpoint`,
DeepSpeed's private names).

Scripts and tests that inspect, copy or patch a checkpoint's files ask the engine where a file of this
rank lives rather than spelling the names themselves. The names are the ones `save_checkpoint` writes
(`ds_engine._checkpoint.checkpoint`, `ds_engine._checkpoint.moe_checkpoint`), so the answer is the file that exists.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from ds_engine._checkpoint import checkpoint as _checkpoint
from ds_engine._checkpoint import moe_checkpoint as _moe_checkpoint
from ds_engine._checkpoint.recovery_script import change_recovery_script_permissions

if TYPE_CHECKING:
    from ds_engine._checkpoint.checkpointer import Checkpointer

__all__ = ["EngineCheckpointNames"]


class EngineCheckpointNames:
    """Mixed into `DeepSpeedEngine`."""

    _mp_rank: int
    _dp_rank: int
    _checkpointer: Checkpointer

    def commit_checkpoint(self) -> bool:
        """Under `checkpoint.writer.decoupled`: wait until every rank wrote the last save's files, then move
        `latest` (collective). The next save, load, optimizer step boundary (once the files are written) and
        `destroy()` do it too. Returns False when nothing was pending.

        Raises:
            DecoupledCheckpointError: a background write failed, naming the file; `latest` was not moved.
        """
        return self._checkpointer.commit()

    def _commit_decoupled_checkpoint(self) -> None:
        """DeepSpeed's name for `commit_checkpoint`."""
        self._checkpointer.commit()

    def _change_recovery_script_permissions(self, dst: str | Path) -> None:
        """DeepSpeed's private chmod step for a checkpoint's `zero_to_fp32.py`: make `dst` executable, or log
        on the "DeepSpeed" logger (INFO) why not and go on (`_recovery_script`)."""
        change_recovery_script_permissions(dst)

    def _get_ckpt_name(
        self, checkpoints_path: str | os.PathLike[str], tag: object, mp_placeholder: str | None = None
    ) -> str:
        """This rank's model-states file: `<path>/<tag>/mp_rank_XX_model_states.pt` (`mp_placeholder`, e.g.
        `"*"`, replaces the two-digit model-parallel rank to match every rank's file)."""
        ckpt_dir = Path(checkpoints_path) / str(tag)
        if mp_placeholder is not None:
            return str(ckpt_dir / f"mp_rank_{mp_placeholder}_model_states.pt")
        return str(_checkpoint.model_file(ckpt_dir, self._mp_rank))

    def _get_zero_ckpt_name(self, checkpoints_path: str | os.PathLike[str], tag: object) -> str:
        """This rank's ZeRO partition file: `<path>/<tag>/zero_pp_rank_<dp>_mp_rank_XX_optim_states.pt`."""
        return str(_checkpoint.zero_file(Path(checkpoints_path) / str(tag), self._dp_rank, self._mp_rank))

    @staticmethod
    def _get_expert_ckpt_name(
        checkpoints_path: str | os.PathLike[str],
        layer_id: int,
        expert_id: int,
        tag: object,
        mpu: object = None,
        checkpoint_mp_rank: int | None = None,
    ) -> str:
        """Expert `expert_id` of the `layer_id`-th MoE layer:
        `<path>/<tag>/layer_<L>_expert_<E>_mp_rank_XX_model_states.pt` (`layer_id` -1: DeepSpeed's pre-layer name
        `expert_<E>_mp_rank_XX_model_states.pt`); XX is `checkpoint_mp_rank`, else `mpu`'s model-parallel rank,
        else 0."""
        mp_rank = checkpoint_mp_rank if checkpoint_mp_rank is not None else _moe_checkpoint.expert_file_mp_rank(mpu)
        ckpt_dir = Path(checkpoints_path) / ("" if tag is None else str(tag))
        if layer_id <= -1:
            return str(ckpt_dir / f"expert_{expert_id}_mp_rank_{mp_rank:02d}_model_states.pt")
        return str(_moe_checkpoint.expert_file(ckpt_dir, layer_id, expert_id, mp_rank))

    def _get_optimizer_ckpt_name(self, checkpoints_path: str | os.PathLike[str], tag: object, expp_rank: int) -> str:
        """The stage-0 optimizer file of expert-parallel rank `expp_rank` in a model with MoE layers:
        `<path>/<tag>/expp_rank_<R>_mp_rank_XX_optim_states.pt`."""
        return str(_moe_checkpoint.optimizer_file(Path(checkpoints_path) / str(tag), int(expp_rank), self._mp_rank))
