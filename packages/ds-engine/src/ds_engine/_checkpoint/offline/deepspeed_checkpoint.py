"""`DeepSpeedCheckpoint`: one tag directory of a checkpoint (ds's or DeepSpeed's), read without an engine.

Offline tools (format converters, inspection scripts) open a saved checkpoint with it to find its
files, its parallel layout and its saved states. Each `mp_rank_XX_model_states.pt` is loaded once (mmapped), at
construction, and only a summary of it is kept (`model_state_metadata`, see `model_state_metadata.py`)
plus rank 0's iteration, `args` and checkpoint-info keys: a model-states file may hold the whole model.
The layout is `get_model_3d_descriptor`'s: the recorded `checkpoint_parallel_dimensions` (ds and
DeepSpeed 0.19.8 write it), else DeepSpeed's rule for older files; dp is the number of optimizer-state
files per model-parallel rank (1 for a checkpoint without ZeRO). Every file goes through
`ds_comm.load_checkpoint_file` (restricted unpickling, errors naming the file).

Reading a checkpoint into a different layout (DeepSpeed's reshaping) is not done here: convert it to a
universal checkpoint (`ds_to_universal`) and load that at the new world size. `ZeROCheckpoint` maps the
optimizer-state files onto a smaller layout for tools that merge them themselves.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import ds_comm
from ds_engine._checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO
from ds_engine._checkpoint.offline.model_state_metadata import summarize_model_state
from ds_engine._checkpoint.offline.reshape_3d_utils import get_model_3d_descriptor_from_metadata

__all__ = ["DeepSpeedCheckpoint"]

_MODEL_RE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_ZERO_RE = re.compile(r"^(?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_?optim_states\.pt$")
_LAYER_RE = re.compile(r"^layer_(\d+)(?:-model_(\d+))?-model_states\.pt$")

ARGS_KEY = "args"
CHECKPOINT_INFO_KEY = "checkpoint_info"
ITERATION_KEY = "iteration"
# Rank 0's top-level values kept at construction, so reading them loads no file again.
_GLOBAL_KEYS = (ITERATION_KEY, "global_steps", ARGS_KEY, CHECKPOINT_INFO_KEY, UNIVERSAL_CHECKPOINT_INFO)


class DeepSpeedCheckpoint:
    """The files, layout and states of the checkpoint in `dir` (a tag directory such as `ckpt/global_step10`).

    Args:
        dir: the tag directory.
        tp_degree, pp_degree, dp_degree: the layout the caller means to read it into; None takes the
            checkpoint's own. A different value is refused (see the module note).

    Attributes:
        mp_rank_files: the `mp_rank_XX_model_states.pt` paths, in rank order.
        model_state_metadata: one `(path, summary)` pair per model-states file, in rank order.
        zero_files: the optimizer-state paths (any `bf16_`/`fp16_` prefix), by model-parallel then dp rank.
        layer_files: the pipeline `layer_XX[-model_YY]-model_states.pt` paths, by layer then tp rank.
        pp_degree, tp_degree, dp_degree: the checkpoint's layout (`original_*` are the same values).

    Raises:
        FileNotFoundError: `dir` is not a directory or holds no `mp_rank_XX_model_states.pt` (a ZeRO-3
            checkpoint has per-rank model states instead; consolidate it with `zero_to_fp32`).
        ValueError: missing ranks, or unequal optimizer-state files per model-parallel rank.
        CheckpointLayoutError (a RuntimeError and a ValueError): model-states files that disagree on the
            layout, or a layout that does not match the file counts.
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
        self.model_state_metadata: list[tuple[str, dict[str, Any]]] = []
        self.global_state: dict[str, Any] = {}
        for mp, path in enumerate(self.mp_rank_files):
            state = ds_comm.load_checkpoint_file(path, mmap=True)  # tensors stay on disk: only the summary is read
            self.model_state_metadata.append((path, summarize_model_state(state)))
            if mp == 0:
                self.global_state = {key: state.get(key) for key in _GLOBAL_KEYS}
            del state  # drop the mapping before the next file

        zero: dict[tuple[int, int], str] = {}
        for name in names:
            if m := _ZERO_RE.match(name):
                zero[(int(m.group(2)), int(m.group(1)))] = str(folder / name)
        self.zero_files = [zero[key] for key in sorted(zero)]
        per_mp = {mp: sum(1 for k in zero if k[0] == mp) for mp in range(len(models))}
        if zero and len(set(per_mp.values())) != 1:
            raise ValueError(f"{folder}: optimizer-state files per mp rank differ: {per_mp}")
        self._zero = zero
        layout = get_model_3d_descriptor_from_metadata(
            [str(folder / n) for n in names], list(zero.values()), self.model_state_metadata
        )
        self.pp_degree, self.tp_degree, self.dp_degree = layout.pp_degree, layout.tp_degree, layout.dp_degree

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

    def _mp_rank(self, pp_index: int, tp_index: int) -> int:
        if not (0 <= pp_index < self.pp_degree and 0 <= tp_index < self.tp_degree):
            raise IndexError(
                f"pp_index {pp_index} / tp_index {tp_index} outside the checkpoint's pp {self.pp_degree} x "
                f"tp {self.tp_degree}"
            )
        return pp_index * self.tp_degree + tp_index

    def get_model_state(self, pp_index: int = 0, tp_index: int = 0) -> dict[str, Any]:
        """The model-states dict of one model-parallel rank, loaded now."""
        return ds_comm.load_checkpoint_file(self.mp_rank_files[self._mp_rank(pp_index, tp_index)])

    def _global_value(self, key: str) -> Any:
        """A top-level value of mp rank 0's model states (None if absent); loads the file once per new key."""
        if key not in self.global_state:
            self.global_state[key] = ds_comm.load_checkpoint_file(self.mp_rank_files[0]).get(key)
        return self.global_state[key]

    def get_checkpoint_info(self, info_key: str = CHECKPOINT_INFO_KEY) -> Any:
        """A top-level value of mp rank 0's model states: Megatron's `checkpoint_info` by default, or
        `universal_checkpoint_info` and the like by name; None if absent."""
        return self._global_value(info_key)

    def get_iteration(self) -> int:
        """The step the checkpoint was saved at (`iteration` when a training script stored it, else `global_steps`)."""
        iteration = self._global_value(ITERATION_KEY)
        if iteration is not None:
            return int(iteration)
        return int(self._global_value("global_steps") or 0)

    def get_args(self) -> Any:
        """The training script's `args`, when it stored them (Megatron-style scripts do), else None."""
        return self._global_value(ARGS_KEY)

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
