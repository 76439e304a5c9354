"""DeepSpeedEngine's checkpoint file-name methods (`_get_ckpt_name`, `_get_zero_ckpt_name`, `_get_optimizer_ckpt_name`).

Scripts and tests that inspect, copy or patch a checkpoint's files ask the engine where a file of this
rank lives rather than spelling the names themselves. The names are the ones `save_checkpoint` writes
(`ds_engine._checkpoint.checkpoint`, `ds_engine._checkpoint.moe_checkpoint`), so the answer is the file that exists.
"""

from __future__ import annotations

import os
from pathlib import Path

from ds_engine._checkpoint import checkpoint as _checkpoint
from ds_engine._checkpoint import moe_checkpoint as _moe_checkpoint

__all__ = ["EngineCheckpointNames"]


class EngineCheckpointNames:
    """Mixed into `DeepSpeedEngine`."""

    _mp_rank: int
    _dp_rank: int

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

    def _get_optimizer_ckpt_name(self, checkpoints_path: str | os.PathLike[str], tag: object, expp_rank: int) -> str:
        """The stage-0 optimizer file of expert-parallel rank `expp_rank` in a model with MoE layers:
        `<path>/<tag>/expp_rank_<R>_mp_rank_XX_optim_states.pt`."""
        return str(_moe_checkpoint.optimizer_file(Path(checkpoints_path) / str(tag), int(expp_rank), self._mp_rank))
