"""DeepSpeed's intermediate slice files of a universal conversion, and merging them by the categories.

DeepSpeed's `ds_to_universal` first dumps every ZeRO fragment to its own file,
`<tmp>/<param>/<tp_rank>/<state>.<dp_rank:02d>` (a flat tensor; `step` a value), then merges each
parameter's fragments into `zero/<param>/<state>.pt`. ds's converter (`universal_write.py`) merges in
memory and writes no such files; these functions give DeepSpeed's file-level steps over the same merge
rules (`Categories`), for tools and tests that drive DeepSpeed's steps one by one:

* `merge_zero_shards(param_dir, state, tp_degree, slice_shapes)`: each tensor-parallel rank's fragments
  of one state, concatenated in data-parallel order (and reshaped to that rank's shape when given). A
  rank that owns none of an unevenly cut parameter writes no fragment; it gets an empty slice of its
  recorded (empty) shape, so later ranks keep their positions.
* `merge_tp_slices(info, out_dir, slice_dir, tp_degree, (name, per_tp_shapes))`: `step.pt` and the
  `fp32`/`exp_avg`/`exp_avg_sq` state files of one parameter; returns the category patterns still unused.
* `group_per_tp_shapes(shapes_by_mp_file, pp_degree, tp_degree)`: the per-rank `param_shapes` of the
  `mp_rank_XX` files (pipeline-stage major: file `pp * tp_degree + tp`) as one shape per tensor-parallel
  rank for every parameter, the stages of one rank united.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

import ds_comm
from ds_zero._checkpoint.sub_param_merge import UniversalMergeError
from ds_zero._checkpoint.universal_categories import Categories

__all__ = ["group_per_tp_shapes", "merge_tp_slices", "merge_zero_shards"]

_STATES = ("fp32", "exp_avg", "exp_avg_sq")


def _load(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=False)


def merge_zero_shards(
    param_dir: str | os.PathLike[str],
    state: str,
    tp_degree: int,
    slice_shapes: Sequence[Sequence[int] | None] | None = None,
) -> list[Any]:
    """Every tensor-parallel rank's `state` of one parameter from its fragment files, in rank order.

    Returns an empty list when no rank wrote `state` (the parameter has no such state).

    Raises:
        UniversalMergeError: a rank that wrote no fragment although its recorded shape is not empty, or
            ranks whose `step` fragments differ.
        ValueError: a fragment file name without a data-parallel rank.
    """
    root = Path(param_dir)
    slices: list[Any] = []
    missing: list[tuple[int, int]] = []
    for tp in range(tp_degree):
        folder = root / str(tp)
        pattern = re.compile(rf"{re.escape(state)}\.(\d+)")
        files = {}
        for path in folder.glob(f"{state}.*") if folder.is_dir() else []:
            match = pattern.fullmatch(path.name)
            if match is None:
                raise ValueError(f"cannot read a data-parallel rank from fragment file {path}")
            files[int(match.group(1))] = path
        if not files:
            missing.append((tp, len(slices)))
            continue
        shards = [_load(files[dp]) for dp in sorted(files)]
        if state == "step":
            if any(not _equal(shards[0], s) for s in shards[1:]):
                raise UniversalMergeError(f"{folder}: the data-parallel ranks hold different steps {shards}")
            slices.append(shards[0])
            continue
        merged = torch.cat([s.reshape(-1) for s in shards])
        slices.append(merged if slice_shapes is None else merged.reshape(list(slice_shapes[tp] or ())))
    if missing and slice_shapes is not None and slices and isinstance(slices[0], torch.Tensor):
        for tp, at in reversed(missing):
            shape = list(slice_shapes[tp] or ())
            if math.prod(shape) != 0:
                raise UniversalMergeError(
                    f"{root}: tensor-parallel rank {tp} wrote no {state} fragment, but its recorded shape "
                    f"{tuple(shape)} is not empty: fragments were lost"
                )
            slices.insert(at, torch.empty(shape, dtype=slices[0].dtype))
    return slices


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a, b)
    return bool(a == b)


def merge_tp_slices(
    info: Mapping[str, Any],
    out_dir: str | os.PathLike[str],
    slice_dir: str | os.PathLike[str],
    tp_degree: int,
    name_and_shapes: tuple[str, Sequence[Sequence[int] | None]],
    *,
    record: Callable[[dict[str, Any]], Any] = dict,
) -> set[str]:
    """Write `out_dir/<name>/{step,fp32,exp_avg,exp_avg_sq}.pt` of one parameter from its slice files.

    Args:
        info: the checkpoint's `universal_checkpoint_info`.
        out_dir: the universal checkpoint's `zero` folder.
        slice_dir: the folder of the fragment files (`<slice_dir>/<name>/<tp>/<state>.<dp>`).
        tp_degree: tensor-parallel ranks.
        name_and_shapes: the parameter and every rank's shape of it (None: unknown).
        record: turns a fused projection's `sub_param_shape` dict into what is saved (DeepSpeed saves its
            `SubparamShape`).

    Returns:
        The category patterns of `info` this parameter did not match (a pattern no parameter matches is
        unused).

    Raises:
        ValueError: unconvertible parameters in `info`, slices the categories cannot merge.
    """
    name, shapes = name_and_shapes
    categories = Categories(info)
    source, target = Path(slice_dir) / name, Path(out_dir) / name
    steps = merge_zero_shards(source, "step", tp_degree, shapes)
    if steps:
        target.mkdir(parents=True, exist_ok=True)
        ds_comm.atomic_save(steps[0], target / "step.pt")
    for state in _STATES:
        slices = merge_zero_shards(source, state, tp_degree, shapes)
        if not slices:  # ZeRO holds no state for a parameter that never had a gradient
            continue
        payload = categories.payload(name, slices, state)
        if "sub_param_shape" in payload:
            payload["sub_param_shape"] = record(payload["sub_param_shape"])
        target.mkdir(parents=True, exist_ok=True)
        ds_comm.atomic_save(payload, target / f"{state}.pt")
    return set(categories.unused)


def group_per_tp_shapes(
    shapes_by_mp_file: Sequence[Mapping[str, Any]], pp_degree: int, tp_degree: int
) -> dict[str, list[Any]]:
    """Parameter name -> its shape on every tensor-parallel rank (None where a rank has no such parameter).

    `shapes_by_mp_file[pp * tp_degree + tp]` is pipeline stage `pp`'s, tensor-parallel rank `tp`'s
    `param_shapes`; a rank's stages are united, so a parameter of one stage only keeps its shapes.

    Raises:
        UniversalMergeError: fewer files than `pp_degree * tp_degree`, or pipeline replicas of one parameter
            (a tied weight) with different shapes on one rank.
    """
    if len(shapes_by_mp_file) < pp_degree * tp_degree:
        raise UniversalMergeError(
            f"{len(shapes_by_mp_file)} model-states files for {pp_degree} pipeline stages x {tp_degree} "
            "tensor-parallel ranks"
        )
    per_tp: list[dict[str, Any]] = []
    for tp in range(tp_degree):
        merged: dict[str, Any] = {}
        for pp in range(pp_degree):
            for name, shape in shapes_by_mp_file[pp * tp_degree + tp].items():
                if name in merged and tuple(merged[name]) != tuple(shape):
                    raise UniversalMergeError(
                        f"pipeline replicas of {name!r} on tensor-parallel rank {tp} disagree on shape: "
                        f"{tuple(merged[name])} vs {tuple(shape)}"
                    )
                merged[name] = shape
        per_tp.append(merged)
    names = {n for shapes in per_tp for n in shapes}
    return {n: [shapes.get(n) for shapes in per_tp] for n in sorted(names)}
