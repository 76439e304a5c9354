"""`DeepSpeedCheckpoint`: one tag directory of a checkpoint (ds's or DeepSpeed's), read without an engine.

Offline tools (format converters, inspection scripts) open a saved checkpoint with it to find its
files, its parallel layout and its saved states. The layout comes from the model-states files:
`checkpoint_parallel_dimensions` gives the pipeline and tensor-parallel degrees when present (ds and
recent DeepSpeed write it); otherwise the pipeline degree is the count of `mp_rank_XX` files and the
tensor-parallel degree 1. The data-parallel degree is the number of optimizer-state files per
model-parallel rank (1 for a checkpoint without ZeRO). Every file goes through
`ds_comm.load_checkpoint_file` (restricted unpickling, errors naming the file); the model-states files
are read once, at construction.

Reading a checkpoint into a different layout (DeepSpeed's reshaping) is not done here: convert it to a
universal checkpoint (`ds_to_universal`) and load that at the new world size.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import ds_comm
from ds_engine.checkpoint.constants import (
    CHECKPOINT_PARALLEL_DIMS,
    CHECKPOINT_PP_DEGREE,
    CHECKPOINT_TP_DEGREE,
    UNIVERSAL_CHECKPOINT_INFO,
)

__all__ = ["DeepSpeedCheckpoint"]

_MODEL_RE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_ZERO_RE = re.compile(r"^(?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_?optim_states\.pt$")
_LAYER_RE = re.compile(r"^layer_(\d+)(?:-model_(\d+))?-model_states\.pt$")


def _degrees(folder: Path, states: list[dict[str, Any]]) -> tuple[int, int]:
    """(pp, tp) from the model-states files; every file that records them must agree."""
    recorded = [s.get(CHECKPOINT_PARALLEL_DIMS) for s in states]
    if all(r is None for r in recorded):
        return len(states), 1
    if any(r is None for r in recorded):
        raise ValueError(f"{folder}: {CHECKPOINT_PARALLEL_DIMS!r} is missing from some model-states files")
    pairs = {
        (int(r.get(CHECKPOINT_PP_DEGREE, 1)), int(r.get(CHECKPOINT_TP_DEGREE, 1))) for r in recorded if r is not None
    }
    if len(pairs) != 1:
        raise ValueError(f"{folder}: the model-states files disagree on (pp, tp) degrees: {sorted(pairs)}")
    pp, tp = pairs.pop()
    if pp * tp != len(states):
        raise ValueError(f"{folder}: pp {pp} x tp {tp} model-parallel ranks but {len(states)} mp_rank files")
    return pp, tp


class DeepSpeedCheckpoint:
    """The files, layout and states of the checkpoint in `dir` (a tag directory such as `ckpt/global_step10`).

    Args:
        dir: the tag directory.
        tp_degree, pp_degree, dp_degree: the layout the caller means to read it into; None takes the
            checkpoint's own. A different value is refused (see the module note).

    Attributes:
        mp_rank_files: the `mp_rank_XX_model_states.pt` paths, in rank order.
        zero_files: the optimizer-state paths (any `bf16_`/`fp16_` prefix), by model-parallel then dp rank.
        layer_files: the pipeline `layer_XX[-model_YY]-model_states.pt` paths, by layer then tp rank.
        pp_degree, tp_degree, dp_degree: the checkpoint's layout (`original_*` are the same values).

    Raises:
        FileNotFoundError: `dir` is not a directory or holds no `mp_rank_XX_model_states.pt` (a ZeRO-3
            checkpoint has per-rank model states instead; consolidate it with `zero_to_fp32`).
        ValueError: missing ranks, or model-states files that disagree on the layout.
        NotImplementedError: a requested degree differs from the checkpoint's.
    """

    def __init__(
        self,
        dir: str | os.PathLike[str],  # noqa: A002 - DeepSpeed's argument name
        tp_degree: int | None = None,
        pp_degree: int | None = None,
        dp_degree: int | None = None,
    ) -> None:
        folder = Path(dir)
        if not folder.is_dir():
            raise FileNotFoundError(f"DeepSpeedCheckpoint: {folder} is not a directory")
        self.dir = str(folder)
        names = sorted(p.name for p in folder.iterdir())
        models = {int(m.group(1)): n for n in names if (m := _MODEL_RE.match(n))}
        if not models:
            raise FileNotFoundError(
                f"DeepSpeedCheckpoint: no mp_rank_XX_model_states.pt in {folder}; pass a tag directory "
                "(a ZeRO-3 checkpoint keeps per-rank model states: consolidate it with zero_to_fp32)"
            )
        if sorted(models) != list(range(len(models))):
            raise ValueError(f"{folder}: model-states files cover mp ranks {sorted(models)}; some are missing")
        self.mp_rank_files = [str(folder / models[r]) for r in range(len(models))]
        self._model_states = [ds_comm.load_checkpoint_file(f) for f in self.mp_rank_files]
        self.pp_degree, self.tp_degree = _degrees(folder, self._model_states)

        zero: dict[tuple[int, int], str] = {}
        for name in names:
            if m := _ZERO_RE.match(name):
                zero[(int(m.group(2)), int(m.group(1)))] = str(folder / name)
        self.zero_files = [zero[key] for key in sorted(zero)]
        per_mp = {mp: sum(1 for k in zero if k[0] == mp) for mp in range(len(models))}
        if zero and len(set(per_mp.values())) != 1:
            raise ValueError(f"{folder}: optimizer-state files per mp rank differ: {per_mp}")
        self.dp_degree = next(iter(per_mp.values())) if zero else 1
        self._zero = zero

        layers = sorted(((int(m.group(1)), int(m.group(2) or 0)), n) for n in names if (m := _LAYER_RE.match(n)))
        self.layer_files = [str(folder / n) for _, n in layers]
        self._layers = {key: str(folder / n) for key, n in layers}

        self.original_pp_degree, self.original_tp_degree, self.original_dp_degree = (
            self.pp_degree,
            self.tp_degree,
            self.dp_degree,
        )
        for name, wanted, have in (
            ("tp_degree", tp_degree, self.tp_degree),
            ("pp_degree", pp_degree, self.pp_degree),
            ("dp_degree", dp_degree, self.dp_degree),
        ):
            if wanted is not None and wanted != have:
                raise NotImplementedError(
                    f"DeepSpeedCheckpoint: {name}={wanted} but the checkpoint was saved with {have}; reading it "
                    "into another layout is not supported: convert it with ds_to_universal and load the "
                    "universal checkpoint at the new world size"
                )

    @property
    def model_state_metadata(self) -> list[dict[str, Any]]:
        """Each model-parallel rank's model-states dict, as loaded (shared, not copied)."""
        return self._model_states

    def _mp_rank(self, pp_index: int, tp_index: int) -> int:
        if not (0 <= pp_index < self.pp_degree and 0 <= tp_index < self.tp_degree):
            raise IndexError(
                f"pp_index {pp_index} / tp_index {tp_index} outside the checkpoint's pp {self.pp_degree} x "
                f"tp {self.tp_degree}"
            )
        return pp_index * self.tp_degree + tp_index

    def get_model_state(self, pp_index: int = 0, tp_index: int = 0) -> dict[str, Any]:
        """The model-states dict of one model-parallel rank."""
        return self._model_states[self._mp_rank(pp_index, tp_index)]

    def get_checkpoint_info(self, info_key: str = UNIVERSAL_CHECKPOINT_INFO) -> Any:
        """`universal_checkpoint_info` (or another top-level key) of mp rank 0's model states; None if absent."""
        return self._model_states[0].get(info_key)

    def get_iteration(self) -> int:
        """The step the checkpoint was saved at (`iteration` when a training script stored it, else `global_steps`)."""
        state = self._model_states[0]
        if "iteration" in state:
            return int(state["iteration"])
        return int(state.get("global_steps", 0))

    def get_args(self) -> Any:
        """The training script's `args`, when it stored them (Megatron-style scripts do), else None."""
        return self._model_states[0].get("args")

    def get_zero_files(self, pp_index: int, tp_index: int, dp_index: int) -> list[str]:
        """The optimizer-state file of one (pp, tp, dp) rank, as a one-element list ([] without ZeRO)."""
        mp = self._mp_rank(pp_index, tp_index)
        path = self._zero.get((mp, dp_index))
        if path is None and self._zero:
            raise IndexError(f"no optimizer-state file for mp rank {mp}, dp rank {dp_index} in {self.dir}")
        return [path] if path is not None else []

    def get_zero_checkpoint_state(self, pp_index: int, tp_index: int, dp_index: int) -> dict[str, Any]:
        """The optimizer-states dict of one (pp, tp, dp) rank, loaded now."""
        files = self.get_zero_files(pp_index, tp_index, dp_index)
        if not files:
            raise FileNotFoundError(f"{self.dir} holds no optimizer-state files (a checkpoint without ZeRO)")
        return ds_comm.load_checkpoint_file(files[0])

    def get_layer_state(self, layer_index: int, tp_index: int = 0) -> dict[str, Any]:
        """The state_dict a pipeline checkpoint saved for global layer `layer_index`, loaded now."""
        path = self._layers.get((layer_index, tp_index))
        if path is None:
            raise IndexError(f"no layer file for layer {layer_index}, tp rank {tp_index} in {self.dir}")
        return ds_comm.load_checkpoint_file(path)

    def __repr__(self) -> str:
        return (
            f"DeepSpeedCheckpoint({self.dir!r}, pp={self.pp_degree}, tp={self.tp_degree}, dp={self.dp_degree}, "
            f"{len(self.layer_files)} layer files)"
        )
