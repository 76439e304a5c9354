"""DeepSpeed's own ZeRO optimizer-state files, translated into ds-zero's checkpoint format (version 1).

DeepSpeed 0.19.8 writes, per data-parallel rank, `{"optimizer_state_dict": ..., "ds_version": ...}`:

* stage 1/2: one flat fp32 partition per param group (`single_partition_of_fp32_groups`, its trailing
  padding cut off; `group_paddings` says how much), the base optimizer's state over those partitions,
  and `param_slice_mappings` (per parameter: `numel` and `start` inside this rank's partition). The
  group's parameters lie back to back in `param_shapes` order (plus `param_alignment_paddings`), and
  rank r holds elements `[r * P, (r + 1) * P)` of that flat group.
* stage 3: every parameter is split on its own: each rank holds `ceil(numel / dp)` elements of it
  (the last rank's tail zero-padded), one after another in `param_shapes` order, in
  `fp32_flat_groups` (one per sub-group); the base optimizer's state follows the same flats.

`from_deepspeed` rebuilds the fragments (`[name, param_start, numel, partition_start]`) from
those rules, checks them against `param_slice_mappings` where DeepSpeed wrote it, and returns the
dict ds-zero's loaders and `zero_to_fp32` already read at any world size and any stage.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ds_zero._checkpoint.format import FORMAT_VERSION, partition_metadata
from ds_zero._partition import Fragment

__all__ = ["from_deepspeed", "is_deepspeed_state_dict"]


def is_deepspeed_state_dict(sd: Mapping[str, Any]) -> bool:
    """Whether an `optimizer_state_dict` was written by DeepSpeed (not by ds-zero)."""
    return "ds_zero_format" not in sd and ("fp32_flat_groups" in sd or "single_partition_of_fp32_groups" in sd)


def _int(value: Any) -> int:
    if isinstance(value, (list, tuple)):
        value = value[0]
    return int(value)


def _fragments(names: Sequence[str], numels: Sequence[int], spans: Sequence[int], lo: int, hi: int) -> list[Fragment]:
    """Fragments of the params laid out back to back (each taking `spans[i]` slots) that fall in `[lo, hi)`."""
    out = []
    offset = 0
    for name, numel, span in zip(names, numels, spans, strict=True):
        a, b = max(lo, offset), min(hi, offset + numel)
        if a < b:
            out.append(Fragment(name, a - offset, b - a, a - lo))
        offset += span
    return out


def _stage12(
    sd: Mapping[str, Any], dp_rank: int, world: int, param_shapes: Sequence[Mapping[str, Sequence[int]]]
) -> list[dict[str, Any]]:
    fp32 = sd["single_partition_of_fp32_groups"]
    paddings = list(sd.get("group_paddings", [0] * len(fp32)))
    align = list(sd.get("param_alignment_paddings", [[] for _ in fp32]))
    mappings = sd.get("param_slice_mappings")
    metas = []
    for g, part in enumerate(fp32):
        shapes = param_shapes[g]
        names = list(shapes)
        numels = [math.prod(shapes[n]) for n in names]
        pads = list(align[g]) if g < len(align) and len(align[g]) == len(names) else [0] * len(names)
        spans = [n + int(p) for n, p in zip(numels, pads, strict=True)]
        size = part.numel() + int(paddings[g])
        frags = _fragments(names, numels, spans, dp_rank * size, (dp_rank + 1) * size)
        if mappings is not None and g < len(mappings):
            saved = {name: (int(a.numel), int(a.start)) for name, a in mappings[g].items()}
            derived = {f.name: (f.numel, f.partition_start) for f in frags}
            if saved != derived:
                raise ValueError(
                    f"DeepSpeed's param_slice_mappings of group {g} on rank {dp_rank} ({saved}) do not "
                    f"match the layout derived from param_shapes ({derived}); the model-states file "
                    "and this optimizer file do not belong together"
                )
        metas.append(partition_metadata(g, size, frags, shapes))
    return metas


def _stage3(
    sd: Mapping[str, Any], dp_rank: int, world: int, param_shapes: Sequence[Mapping[str, Sequence[int]]]
) -> list[dict[str, Any]]:
    flats = sd["fp32_flat_groups"]
    queue = [(g, name, tuple(shape)) for g, shapes in enumerate(param_shapes) for name, shape in shapes.items()]
    metas = []
    for flat in flats:
        size = flat.numel()
        names, numels, shapes, used, group = [], [], {}, 0, None
        while queue and used < size:
            g, name, shape = queue[0]
            if group is not None and g != group:
                break
            numel = math.prod(shape)
            per_rank = -(-numel // world)
            group = g
            queue.pop(0)
            names.append(name)
            numels.append(numel)
            shapes[name] = shape
            used += per_rank
        if used != size:
            raise ValueError(
                f"DeepSpeed stage-3 flat group of rank {dp_rank} holds {size} elements, the parameters "
                f"named in param_shapes account for {used}; the files do not belong together"
            )
        frags, at = [], 0
        for name, numel in zip(names, numels, strict=True):
            per_rank = -(-numel // world)
            lo, hi = dp_rank * per_rank, min(numel, (dp_rank + 1) * per_rank)
            if lo < hi:
                frags.append(Fragment(name, lo, hi - lo, at))
            at += per_rank
        metas.append(partition_metadata(int(group or 0), size, frags, shapes))
    if queue:
        raise ValueError(
            f"parameters {[n for _, n, _ in queue[:3]]}... of param_shapes are in no flat group of the "
            f"DeepSpeed stage-3 optimizer file of rank {dp_rank}"
        )
    return metas


def from_deepspeed(
    sd: Mapping[str, Any],
    *,
    dp_rank: int,
    param_shapes: Sequence[Mapping[str, Sequence[int]]],
    model_dtype: torch.dtype = torch.float32,
    shared_params: Mapping[str, str] | None = None,
    frozen_param_shapes: Mapping[str, Sequence[int]] | None = None,
    partition_count: int | None = None,
) -> dict[str, Any]:
    """One rank's DeepSpeed `optimizer_state_dict` as a ds-zero format-1 partition state dict.

    Args:
        sd: the `optimizer_state_dict` of DeepSpeed's `[bf16_]zero_pp_rank_{dp_rank}_..._optim_states.pt`.
        dp_rank: the rank in its file name.
        param_shapes: the model-states file's `param_shapes` (per param group, name -> shape, in order).
        model_dtype: the dtype of the module's parameters in the model-states file.
        partition_count: the data-parallel ranks when `sd` records none (the number of files, as
            DeepSpeed's converter counts them); a recorded `partition_count` wins.

    Raises:
        ValueError: the layout does not add up (names what disagrees).
    """
    stage = int(sd["zero_stage"])
    if "partition_count" not in sd and partition_count is None:
        raise KeyError("partition_count")
    world = _int(sd.get("partition_count", partition_count))
    if stage == 3:
        metas = _stage3(sd, dp_rank, world, param_shapes)
        fp32 = [t.detach().float() for t in sd["fp32_flat_groups"]]
        base = dict(sd["optimizer_state_dict"])
        if isinstance(base.get("state"), list):  # one entry per sub-group, in order
            base["state"] = dict(enumerate(base["state"]))
    else:
        metas = _stage12(sd, dp_rank, world, param_shapes)
        fp32 = [
            torch.cat([t.detach().float(), t.new_zeros(meta["numel"] - t.numel(), dtype=torch.float32)])
            for t, meta in zip(sd["single_partition_of_fp32_groups"], metas, strict=True)
        ]
        base = sd["base_optimizer_state"]
    scaler = sd.get("loss_scaler")
    scaler_state = scaler.state_dict() if hasattr(scaler, "state_dict") else {"cur_scale": 1.0, "dynamic": False}
    return {
        "ds_zero_format": FORMAT_VERSION,
        "zero_stage": stage,
        "partition_count": world,
        "dp_rank": int(dp_rank),
        "model_dtype": str(model_dtype).removeprefix("torch."),
        "offload_optimizer": "none",
        "single_partition_of_fp32_groups": fp32,
        "partitions": metas,
        "base_optimizer_state": base,
        "loss_scaler": scaler_state,
        "dynamic_loss_scale": bool(sd.get("dynamic_loss_scale", False)),
        "overflow": bool(sd.get("overflow", False)),
        "clip_grad": float(sd.get("clip_grad", 0.0) or 0.0),
        "shared_params": dict(shared_params or {}),
        "frozen_param_shapes": {k: list(v) for k, v in (frozen_param_shapes or {}).items()},
    }
