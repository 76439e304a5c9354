"""Saving and loading a stage 1/2 optimizer's partitions in the shared checkpoint format, at any world size."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from ds_zero._checkpoint.format import (
    FORMAT_VERSION,
    FragmentIndex,
    fill_partition,
    is_partition_shaped,
    partition_metadata,
)
from ds_zero._master_dtype import dtype_name
from ds_zero._stage12.flat_buffer import FlatParamGroup

logger = logging.getLogger(__name__)

__all__ = ["build_rank_state_dict", "load_masters", "load_base_optimizer_state"]


def build_rank_state_dict(
    *,
    zero_stage: int,
    dp_rank: int,
    world_size: int,
    flats: list[FlatParamGroup],
    masters: list[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    loss_scaler: Any,
    overflow: bool,
    clip_grad: float,
    offload: bool,
    shared_params: dict[str, str],
    frozen_param_shapes: dict[str, list[int]],
) -> dict[str, Any]:
    """This rank's dict in format version 1 (see `ds_zero._checkpoint.format`).

    The fp32 partitions are copied (an fp32 master is a view of the model's buffer, which keeps changing
    and which `torch.save` would otherwise write whole); optimizer state tensors are references, as in
    `torch.optim.Optimizer.state_dict()`.
    """
    return {
        "ds_zero_format": FORMAT_VERSION,
        "zero_stage": int(zero_stage),
        "partition_count": int(world_size),
        "dp_rank": int(dp_rank),
        "model_dtype": str(next((f.dtype for f in flats if f.numel), torch.float32)).removeprefix("torch."),
        "offload_optimizer": "cpu" if offload else "none",
        "master_dtype": dtype_name(masters[0].dtype if masters else torch.float32),
        "single_partition_of_fp32_groups": [m.detach().to(torch.float32, copy=True) for m in masters],
        "partitions": [
            partition_metadata(g, f.partition_numel, f.fragments(), f.param_shapes()) for g, f in enumerate(flats)
        ],
        "base_optimizer_state": optimizer.state_dict(),
        "loss_scaler": loss_scaler.state_dict(),
        "dynamic_loss_scale": bool(loss_scaler.dynamic),
        "overflow": bool(overflow),
        "clip_grad": float(clip_grad),
        "shared_params": dict(shared_params),
        "frozen_param_shapes": dict(frozen_param_shapes),
    }


def load_masters(index: FragmentIndex, flats: list[FlatParamGroup], masters: list[torch.Tensor]) -> None:
    """Fill this rank's fp32 masters from the saved fp32 partitions of any world size."""
    fp32 = [sd["single_partition_of_fp32_groups"] for sd in index.state_dicts]
    for flat, master in zip(flats, masters, strict=True):
        staging = torch.empty(master.numel(), dtype=torch.float32)
        fill_partition(staging, flat.fragments(), index, lambda rank, k: fp32[rank][k])
        with torch.no_grad():
            master.copy_(staging)


def _saved_partitions_of_group(index: FragmentIndex, group: int) -> list[tuple[int, int]]:
    """`(rank, k)` of every saved partition that belongs to param group `group`."""
    return [
        (rank, k)
        for rank, sd in enumerate(index.state_dicts)
        for k, meta in enumerate(sd["partitions"])
        if int(meta["group_index"]) == group
    ]


def load_base_optimizer_state(
    index: FragmentIndex, flats: list[FlatParamGroup], masters: list[torch.Tensor], optimizer: torch.optim.Optimizer
) -> None:
    """Re-partition the saved base-optimizer state onto this rank's partitions and load it.

    Partition-shaped values (exp_avg, ...) follow the fragments; per-group values (`step`) come from the
    first saved partition of the same group. Hyper-parameters (`lr`, `betas`, ...) come from rank 0's
    saved param groups.

    Raises:
        ValueError: the saved optimizer has a different number of param groups.
    """
    saved0 = index.state_dicts[0]["base_optimizer_state"]
    saved_groups = saved0["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"the checkpoint's optimizer has {len(saved_groups)} param groups, this one has "
            f"{len(optimizer.param_groups)}; build the optimizer with the same groups as when saving"
        )
    saved_state = [sd["base_optimizer_state"]["state"] for sd in index.state_dicts]
    state: dict[int, dict[str, Any]] = {}
    for g, (flat, master) in enumerate(zip(flats, masters, strict=True)):
        sources = _saved_partitions_of_group(index, g)
        saved_states = [(r, k, saved_state[r].get(k)) for r, k in sources]
        present = [(r, k, s) for r, k, s in saved_states if s]
        if not present:
            continue
        _, _, template = present[0]
        new: dict[str, Any] = {}
        for key, value in template.items():
            r0, k0, _ = present[0]
            old_numel = int(index.state_dicts[r0]["partitions"][k0]["numel"])
            if is_partition_shaped(value, old_numel):
                dst = torch.empty(master.numel(), dtype=value.dtype)
                fill_partition(dst, flat.fragments(), index, lambda rank, k, key=key: saved_state[rank][k][key])
                new[key] = dst
            else:
                new[key] = value.clone() if isinstance(value, torch.Tensor) else value
        state[g] = new
    groups = []
    for g, saved in enumerate(saved_groups):
        # Saved hyper-parameters win; keys only this optimizer has (another optimizer class saved the
        # checkpoint: torch's AdamW under DeepSpeed, ds-ops' CPU Adam with offload here) keep their values.
        group = {k: v for k, v in {**optimizer.param_groups[g], **saved}.items() if k != "params"}
        for key in _IDENTITY_KEYS:  # what the group IS stays this run's (an MoE group's name follows ep_size)
            if key in optimizer.param_groups[g]:
                group[key] = optimizer.param_groups[g][key]
        group["params"] = [g]
        groups.append(group)
    optimizer.load_state_dict({"state": state, "param_groups": groups})


#: Param-group keys that name the group rather than tune it: kept from the running optimizer on load.
_IDENTITY_KEYS = ("name", "moe")


def as_state_dict_list(state_dicts: list[Mapping[str, Any]] | Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """Accept one dict only when it is a whole save (a 1-rank save); otherwise require the list."""
    if isinstance(state_dicts, Mapping):
        count = state_dicts.get("partition_count")
        if count == 1:
            return [state_dicts]
        raise TypeError(
            f"load_state_dict needs the state dicts of ALL {count} saved ranks as a list in rank order "
            "(each rank's dict holds only its partition), got a single dict"
        )
    return list(state_dicts)
