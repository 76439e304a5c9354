"""ds-zero partitions laid out as DeepSpeed 0.19.8 lays out its own, for files DeepSpeed loads.

DeepSpeed reads its ZeRO files "rigidly": rank r takes its own file and copies the tensors into its
own flat partitions, so the layout must be exactly the one DeepSpeed would build for the model at that
world size (`ds_zero._checkpoint.deepspeed_format` describes it; this is the inverse):

* stage 1/2: per param group, the parameters back to back in `param_shapes` order, the group padded
  to a multiple of `2 * world` (DeepSpeed's `nccl_start_alignment_factor` times the world size) and
  cut into `world` equal partitions; the fp32 partition is stored without its padding
  (`group_paddings`), the optimizer state with it.
* stage 3: each parameter cut into `world` slices of `ceil(numel / world)`, rank r's slices back to
  back (one flat per param group, DeepSpeed's default sub-group size).

Values come from a `FragmentIndex` over the ds-zero state dicts of any world size, so a checkpoint
ds saved at one world size can be written for DeepSpeed at another.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ds_comm.checkpoint_files import (
    DeepSpeedDynamicLossScaler,
    DeepSpeedFragmentAddress,
    DeepSpeedLossScaler,
    DeepSpeedZeroStage,
)
from ds_zero._checkpoint.deepspeed_format import _fragments
from ds_zero._checkpoint.format import FragmentIndex, fill_partition, is_partition_shaped
from ds_zero._partition import Fragment

__all__ = ["DEEPSPEED_VERSION", "deepspeed_rank_state_dict"]

#: The DeepSpeed release whose layout is written (and the `ds_version` the files carry).
DEEPSPEED_VERSION = "0.19.8"
_ALIGNMENT = 2


def _address(numel: int, start: int) -> DeepSpeedFragmentAddress:
    address = DeepSpeedFragmentAddress()
    address.__setstate__({"numel": int(numel), "start": int(start)})
    return address


def _scaler(state: Mapping[str, Any]) -> DeepSpeedLossScaler:
    scaler = DeepSpeedDynamicLossScaler() if state.get("dynamic") else DeepSpeedLossScaler()
    scaler.__setstate__(dict(state))
    return scaler


def _layout(
    param_shapes: Sequence[Mapping[str, Sequence[int]]], world: int, rank: int, stage: int
) -> list[tuple[int, int, list[Fragment]]]:
    """Per param group: (partition numel incl. padding, this rank's padding, fragments)."""
    out = []
    for shapes in param_shapes:
        names = list(shapes)
        numels = [math.prod(shapes[n]) for n in names]
        if stage == 3:
            per_rank = [-(-n // world) for n in numels]
            frags, at = [], 0
            for name, numel, size in zip(names, numels, per_rank, strict=True):
                lo, hi = rank * size, min(numel, (rank + 1) * size)
                if lo < hi:
                    frags.append(Fragment(name, lo, hi - lo, at))
                at += size
            out.append((sum(per_rank), 0, frags))
            continue
        total = sum(numels)
        align = _ALIGNMENT * world
        padded = -(-total // align) * align
        size = padded // world
        padding = max(0, min(size, (rank + 1) * size - total))
        out.append((size, padding, _fragments(names, numels, numels, rank * size, (rank + 1) * size)))
    return out


def _group_state(index: FragmentIndex, group: int, size: int, frags: list[Fragment]) -> dict[str, Any]:
    """The base optimizer's state of param group `group`, re-laid onto one DeepSpeed partition."""
    sds = index.state_dicts
    for sd in sds:
        for k, meta in enumerate(sd["partitions"]):
            saved = sd["base_optimizer_state"]["state"].get(k)
            if int(meta["group_index"]) != group or not saved:
                continue
            out: dict[str, Any] = {}
            for key, value in saved.items():
                if is_partition_shaped(value, int(meta["numel"])):
                    dst = torch.zeros(size, dtype=value.dtype)
                    fill_partition(
                        dst, frags, index, lambda r, kk, key=key: sds[r]["base_optimizer_state"]["state"][kk][key]
                    )
                    out[key] = dst
                else:
                    out[key] = value.clone() if isinstance(value, torch.Tensor) else value
            return out
    return {}


def deepspeed_rank_state_dict(
    index: FragmentIndex, param_shapes: Sequence[Mapping[str, Sequence[int]]], *, world: int, rank: int, stage: int
) -> dict[str, Any]:
    """DeepSpeed's `optimizer_state_dict` of data-parallel rank `rank` of `world`, at ZeRO `stage`.

    Args:
        index: every rank's ds-zero partition of one save (any world size).
        param_shapes: per param group, name -> shape, in the order of the model's parameters.
    """
    if stage not in (1, 2, 3):
        raise ValueError(f"DeepSpeed's ZeRO optimizer files exist for stages 1-3, got stage {stage}")
    first = index.state_dicts[0]
    saved_groups = first["base_optimizer_state"]["param_groups"]
    if len(saved_groups) != len(param_shapes):
        raise ValueError(f"the optimizer has {len(saved_groups)} param groups, param_shapes {len(param_shapes)}")
    fp32 = [sd["single_partition_of_fp32_groups"] for sd in index.state_dicts]
    layout = _layout(param_shapes, world, rank, stage)
    flats, states, mappings = [], {}, []
    for g, (size, padding, frags) in enumerate(layout):
        flat = torch.zeros(size, dtype=torch.float32)
        fill_partition(flat, frags, index, lambda r, k: fp32[r][k])
        flats.append(flat if stage == 3 else flat[: size - padding].clone())
        state = _group_state(index, g, size, frags)
        if state:
            states[g] = state
        mappings.append(OrderedDict((f.name, _address(f.numel, f.partition_start)) for f in frags))
    groups = [
        {**{k: v for k, v in saved.items() if k != "params"}, "params": [g]} for g, saved in enumerate(saved_groups)
    ]
    base = {"state": states, "param_groups": groups}
    common = {
        "loss_scaler": _scaler(first.get("loss_scaler") or {"cur_scale": 1.0, "dynamic": False}),
        "dynamic_loss_scale": bool(first.get("dynamic_loss_scale", False)),
        "overflow": bool(first.get("overflow", False)),
    }
    if stage == 3:
        return {
            "zero_stage": DeepSpeedZeroStage(3),
            **common,
            "partition_count": int(world),
            "optimizer_state_dict": base,
            "fp32_flat_groups": flats,
        }
    return {
        **common,
        "clip_grad": float(first.get("clip_grad", 0.0)),
        "base_optimizer_state": base,
        "single_partition_of_fp32_groups": flats,
        "zero_stage": DeepSpeedZeroStage(stage),
        "group_paddings": [padding for _, padding, _ in layout],
        "param_alignment_paddings": [[0] * len(shapes) for shapes in param_shapes],
        "partition_count": [int(world)] * len(layout),
        "ds_version": DEEPSPEED_VERSION,
        "param_slice_mappings": mappings,
    }
