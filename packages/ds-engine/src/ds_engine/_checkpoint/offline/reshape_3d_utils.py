"""`deepspeed.checkpoint.reshape_3d_utils`: a checkpoint's pp/tp/dp degrees, and maps onto smaller ones.

`model_3d_desc(pp, tp, dp)` describes a layout. `src.reshape(target)` says, for each target
data-parallel rank, which source ZeRO files each target (pp, tp) rank reads: the model-parallel
ranks are merged as `reshape_meg_2d` describes, then each merged model-parallel rank `m` stands for
the files of every source data-parallel rank (`m + d * pp * tp` for d = 0..dp-1, the index of
`zero_pp_rank_{d}_mp_rank_{m}` in `get_zero_files` order), and that list is cut into the target's dp
contiguous runs. A target must be no larger than the source in any dimension and divide it (DeepSpeed
0.19.8's `can_reshape` checks only the first; its `reshape` then fails on an uneven split).

`get_model_3d_descriptor(dir)` reads a tag directory's layout: the model-state files' recorded
`checkpoint_parallel_dimensions` (DeepSpeed 0.19.8 and ds write it) give pp and tp, and every file must
record the same; without it (older writers), tp is the number of files of one pipeline layer (or,
with no layer files, the number of `mp_rank_XX` files, pp then 1). dp is the number of ZeRO files per
model-parallel rank (1 without ZeRO).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

import ds_comm
from ds_engine._checkpoint.constants import (
    CHECKPOINT_PARALLEL_DIMS,
    CHECKPOINT_PP_DEGREE,
    CHECKPOINT_TP_DEGREE,
    MODEL_FILE_PREFIX,
    MODEL_FILE_SUFFIX,
)
from ds_engine._checkpoint.offline.reshape_meg_2d import meg_2d_parallel_map, reshape_meg_2d_parallel
from ds_engine._checkpoint.offline.reshape_utils import get_files, get_files_with_prefix, get_zero_files, partition_data

__all__ = [
    "CheckpointLayoutError",
    "get_model_3d_descriptor",
    "get_model_3d_descriptor_from_metadata",
    "model_3d_desc",
]

PP_DIM, TP_DIM, DP_DIM = "PP", "TP", "DP"
_LAYER_RE = re.compile(r"^layer_(\d+)-model_")


class CheckpointLayoutError(RuntimeError, ValueError):
    """A checkpoint's files contradict each other about its layout.

    A RuntimeError as DeepSpeed raises, and a ValueError as ds's readers raised before.
    """


class model_3d_desc:  # noqa: N801 - DeepSpeed's class name
    """A pipeline x tensor x data parallel layout (see the module note for `reshape`)."""

    def __init__(self, pp_degree: int = 1, tp_degree: int = 1, dp_degree: int = 1) -> None:
        for name, value in (("pp_degree", pp_degree), ("tp_degree", tp_degree), ("dp_degree", dp_degree)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"model_3d_desc: {name} must be a positive integer, got {value!r}")
        self.pp_degree = pp_degree
        self.tp_degree = tp_degree
        self.dp_degree = dp_degree

    def _dims(self) -> tuple[tuple[str, int], ...]:
        return ((PP_DIM, self.pp_degree), (TP_DIM, self.tp_degree), (DP_DIM, self.dp_degree))

    def get_desc(self) -> str:
        return f"{PP_DIM},{TP_DIM},{DP_DIM} = ({self.pp_degree}, {self.tp_degree}, {self.dp_degree})"

    def world_size(self) -> int:
        return self.pp_degree * self.tp_degree * self.dp_degree

    def is_valid(self, pp_index: int, tp_index: int, dp_index: int) -> tuple[bool, list[str]]:
        """(whether the indices address a rank of this layout, one message per index out of range)."""
        errors = [
            f"{name} indexing error: index {index} >= degree {degree}"
            for index, (name, degree) in zip((pp_index, tp_index, dp_index), self._dims(), strict=True)
            if index >= degree
        ]
        return not errors, errors

    def can_reshape(self, target_3d_desc: model_3d_desc) -> tuple[bool, list[str]]:
        """(whether `reshape(target_3d_desc)` is possible, one message per dimension that prevents it)."""
        errors = []
        for (name, old), (_, new) in zip(self._dims(), target_3d_desc._dims(), strict=True):
            if new > old:
                errors.append(f"Expansion reshape not supported - {name}: {old} ---> {new}")
            elif old % new:
                errors.append(f"Uneven reshape not supported - {name}: {new} does not divide {old}")
        return not errors, errors

    def reshape(self, target_3d_desc: model_3d_desc, verbose: bool = False) -> list[meg_2d_parallel_map]:
        """One pp x tp map per target dp rank, each cell the source ZeRO file indices that rank reads.

        Raises:
            ValueError: `can_reshape` refuses the target (its messages are joined in the error).
        """
        ok, errors = self.can_reshape(target_3d_desc)
        if not ok:
            raise ValueError(f"cannot reshape {self.get_desc()} to {target_3d_desc.get_desc()}: " + ", ".join(errors))
        model_map = reshape_meg_2d_parallel(
            self.pp_degree, self.tp_degree, target_3d_desc.pp_degree, target_3d_desc.tp_degree, verbose=verbose
        )
        mp_size = self.pp_degree * self.tp_degree
        per_dp = [
            meg_2d_parallel_map(target_3d_desc.pp_degree, target_3d_desc.tp_degree)
            for _ in range(target_3d_desc.dp_degree)
        ]
        for pp_index in range(model_map.pp_degree):
            for tp_index in range(model_map.tp_degree):
                files = [m + d * mp_size for m in model_map.get_data(pp_index, tp_index) for d in range(self.dp_degree)]
                for target, run in zip(per_dp, partition_data(files, target_3d_desc.dp_degree), strict=True):
                    target.add_data(pp_index, tp_index, run)
        return per_dp

    def __eq__(self, other: object) -> bool:
        return isinstance(other, model_3d_desc) and self._dims() == other._dims()

    def __hash__(self) -> int:
        return hash(self._dims())

    def __repr__(self) -> str:
        return f"model_3d_desc(pp_degree={self.pp_degree}, tp_degree={self.tp_degree}, dp_degree={self.dp_degree})"


def _recorded_degrees(model_file: str, dimensions: Any) -> tuple[int, int]:
    if not isinstance(dimensions, dict):
        raise CheckpointLayoutError(f"Checkpoint {CHECKPOINT_PARALLEL_DIMS} must be a dictionary in {model_file}.")
    values = []
    for key in (CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE):
        value = dimensions.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckpointLayoutError(f"Checkpoint {key} must be a positive integer in {model_file}, got {value!r}.")
        values.append(value)
    return values[0], values[1]


def _legacy_degrees(file_list: Sequence[str], num_model_files: int) -> tuple[int, int]:
    """(pp, tp) of a checkpoint that does not record them: from its pipeline layer files, if any."""
    per_layer: dict[int, int] = {}
    for path in file_list:
        if m := _LAYER_RE.match(os.path.basename(path)):
            per_layer[int(m.group(1))] = per_layer.get(int(m.group(1)), 0) + 1
    if not per_layer:
        return 1, num_model_files
    tp = per_layer.get(1, per_layer[min(per_layer)])
    if num_model_files % tp:
        raise CheckpointLayoutError(
            f"Checkpoint has {num_model_files} model-state files but {tp} files per pipeline layer."
        )
    return num_model_files // tp, tp


def get_model_3d_descriptor_from_metadata(
    file_list: Sequence[str], zero_file_list: Sequence[str], model_state_metadata: Sequence[tuple[str, dict[str, Any]]]
) -> model_3d_desc:
    """The layout of a checkpoint from its file names and each model-state file's (path, metadata) pair.

    Only `metadata[CHECKPOINT_PARALLEL_DIMS]` is read (None or absent: not recorded).

    Raises:
        CheckpointLayoutError: the dimensions are recorded in some files but not others, disagree,
            are malformed, or do not match the number of model-state or ZeRO files.
    """
    recorded: list[tuple[int, int]] = []
    missing: list[str] = []
    for model_file, metadata in model_state_metadata:
        dimensions = metadata.get(CHECKPOINT_PARALLEL_DIMS)
        if dimensions is None:
            missing.append(model_file)
        else:
            recorded.append(_recorded_degrees(model_file, dimensions))
    num_model_files = len(model_state_metadata)
    if recorded:
        if missing:
            raise CheckpointLayoutError(
                f"Checkpoint {CHECKPOINT_PARALLEL_DIMS} is missing from model-state files: {missing}"
            )
        if len(set(recorded)) != 1:
            raise CheckpointLayoutError(
                f"Checkpoint {CHECKPOINT_PARALLEL_DIMS} disagrees across model-state files: {recorded}"
            )
        pp, tp = recorded[0]
        if num_model_files != pp * tp:
            raise CheckpointLayoutError(
                f"Checkpoint model-state file count {num_model_files} does not match "
                f"{CHECKPOINT_PP_DEGREE}={pp} * {CHECKPOINT_TP_DEGREE}={tp}."
            )
    else:
        pp, tp = _legacy_degrees(file_list, num_model_files)
    if len(zero_file_list) % (pp * tp):
        raise CheckpointLayoutError(
            f"Checkpoint ZeRO file count {len(zero_file_list)} is not divisible by "
            f"{CHECKPOINT_PP_DEGREE}={pp} * {CHECKPOINT_TP_DEGREE}={tp}."
        )
    return model_3d_desc(pp, tp, max(1, len(zero_file_list) // (pp * tp)))


def model_state_files(file_list: Sequence[str]) -> list[str]:
    """The `mp_rank_XX_model_states.pt` paths of `file_list`, in rank order."""
    return [p for p in get_files_with_prefix(file_list, MODEL_FILE_PREFIX) if p.endswith(MODEL_FILE_SUFFIX)]


def get_model_3d_descriptor(dir: str | os.PathLike[str]) -> model_3d_desc:  # noqa: A002 - DeepSpeed's argument name
    """The pp/tp/dp layout of the checkpoint tag directory `dir` (each model-state file is loaded once, mmapped).

    Raises:
        CheckpointLayoutError: see `get_model_3d_descriptor_from_metadata`.
    """
    file_list = get_files(dir)
    metadata = []
    for model_file in model_state_files(file_list):
        state = ds_comm.load_checkpoint_file(model_file, mmap=True)  # tensors stay on disk
        metadata.append((model_file, {CHECKPOINT_PARALLEL_DIMS: state.get(CHECKPOINT_PARALLEL_DIMS)}))
        del state
    return get_model_3d_descriptor_from_metadata(file_list, get_zero_files(dir), metadata)
