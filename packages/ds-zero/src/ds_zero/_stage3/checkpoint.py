"""Stage-3 checkpoints in the shared ZeRO format, and the consolidated 16-bit state_dict for `save_16bit_model`.

A stage-3 rank's optimizer state dict is the format of `ds_zero._checkpoint.format` (version 1): each
tile of each param group (this rank's shards of a run of the group's parameters, back to back; one
tile per group unless `sub_group_size` cuts it) is one partition, and tile k is the base optimizer's
k-th parameter. A parameter's shard is elements `[r * s, (r + 1) * s)` of it, so each parameter
contributes one fragment per rank (the zero padding of the last shard is no fragment). Frozen
partitioned parameters are saved too, in a trailing partition with `group_index` -1 that no
base-optimizer parameter refers to, so that `zero_to_fp32` rebuilds them and a resume restores them.
`fp32_flat_groups` names the trainable tiles once more, DeepSpeed's key for its own stage-3 flats.
Loading goes through the fragments, so a checkpoint saved at any world size, by any stage, re-partitions
onto this one.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

import ds_comm
from ds_zero._checkpoint.format import (
    FORMAT_VERSION,
    FragmentIndex,
    fill_partition,
    is_partition_shaped,
    partition_metadata,
)
from ds_zero._master_dtype import dtype_name, note_master_conversion
from ds_zero._params.gathered_parameters import GatheredParameters
from ds_zero._params.partitioned_param import is_zero_param, state_of
from ds_zero._params.placement import has_families
from ds_zero._stage12.state import as_state_dict_list

if TYPE_CHECKING:
    from ds_zero._stage3.optimizer import DeepSpeedZeroOptimizer_Stage3
    from ds_zero._stage3.partition import ShardTile

logger = logging.getLogger(__name__)

__all__ = ["consolidated_16bit_state_dict", "load_stage3_state_dicts", "stage3_state_dict"]


def _partitions(opt: DeepSpeedZeroOptimizer_Stage3) -> list[ShardTile]:
    return [*opt.tiles, *opt.frozen.tiles] if opt.frozen.params else opt.tiles


def stage3_state_dict(opt: DeepSpeedZeroOptimizer_Stage3) -> dict[str, Any]:
    """This rank's dict (see the module docstring); fp32 values are copies, optimizer state is referenced."""
    parts = _partitions(opt)
    dtypes = [state_of(p).full.dtype for part in opt.partitions for p in part.params]
    model_dtype = dtypes[0] if dtypes else torch.float32
    values = [part.fp32_values() for part in parts]
    return {
        "ds_zero_format": FORMAT_VERSION,
        "zero_stage": 3,
        "partition_count": int(opt.world_size),
        "dp_rank": int(opt.dp_rank),
        "model_dtype": str(model_dtype).removeprefix("torch."),
        "offload_optimizer": opt.config.offload_optimizer_device,
        "master_dtype": dtype_name(opt.master_weights_and_grads_dtype),
        "single_partition_of_fp32_groups": values,
        # The trainable tiles again under DeepSpeed's stage-3 key (the same tensors: a file stores them once):
        # each parameter's shard in its ceil(numel / world) slot, in param_shapes order, as DeepSpeed lays
        # out its own, so DeepSpeed's zero_to_fp32.py reads a ds save too.
        "fp32_flat_groups": values[: len(opt.tiles)],
        "partitions": [
            partition_metadata(part.group_index, part.numel, part.fragments(), part.param_shapes()) for part in parts
        ],
        "base_optimizer_state": opt.base_optimizer_state_dict(),
        "loss_scaler": opt.loss_scaler.state_dict(),
        "dynamic_loss_scale": bool(opt.loss_scaler.dynamic),
        "overflow": bool(opt.overflow),
        "clip_grad": float(opt.clip_grad),
        "shared_params": dict(opt.shared_params),
        "frozen_param_shapes": dict(opt.frozen_param_shapes),
    }


def load_stage3_state_dicts(
    opt: DeepSpeedZeroOptimizer_Stage3, state_dicts: Any, *, load_optimizer_states: bool, load_from_fp32_weights: bool
) -> None:
    """Fill `opt`'s tiles (masters, shards, frozen shards), base optimizer state and loss scaler.

    Raises:
        ValueError: ranks missing from `state_dicts`, a trainable parameter the checkpoint lacks, or a
            different number of optimizer param groups.
    """
    sds = as_state_dict_list(state_dicts)
    index = FragmentIndex(sds)
    note_master_conversion(index.state_dicts[0], opt.master_weights_and_grads_dtype)
    fp32 = [sd["single_partition_of_fp32_groups"] for sd in sds]
    for tile in _partitions(opt):
        if not tile.params:
            continue
        frozen = tile.master is None
        if frozen and any(state_of(p).name not in index.param_shapes for p in tile.params):
            logger.info("stage 3: the checkpoint has no partitions of the frozen parameters; they keep their values")
            continue
        if frozen or load_from_fp32_weights:
            staging = torch.empty(tile.numel, dtype=torch.float32)
            fill_partition(staging, tile.fragments(), index, lambda rank, k: fp32[rank][k])
            tile.load_fp32_values(staging)
    if not load_from_fp32_weights:
        for part in opt.partitions:
            part.copy_shards_to_master()
    if load_optimizer_states:
        _load_base_optimizer_state(index, opt)
    saved = sds[0]
    if "loss_scaler" in saved and isinstance(saved["loss_scaler"], Mapping):
        opt.loss_scaler.load_state_dict(dict(saved["loss_scaler"]))
    opt.overflow = bool(saved.get("overflow", False))


def _load_base_optimizer_state(index: FragmentIndex, opt: DeepSpeedZeroOptimizer_Stage3) -> None:
    """Re-partition the saved base-optimizer state onto this rank's tiles and load it.

    Tile-shaped values (exp_avg, ...) follow the fragments; per-tile values (`step`) come from the first
    saved partition of the same param group; hyper-parameters from rank 0's saved param groups.
    """
    sds = index.state_dicts
    saved_groups = sds[0]["base_optimizer_state"]["param_groups"]
    groups = opt.optimizer.param_groups
    if len(saved_groups) != len(groups):
        raise ValueError(
            f"the checkpoint's optimizer has {len(saved_groups)} param groups, this one has "
            f"{len(groups)}; build the optimizer with the same groups as when saving"
        )
    sources: dict[int, list[tuple[int, int, dict[str, Any]]]] = {}
    for rank, sd in enumerate(sds):
        states = sd["base_optimizer_state"]["state"]
        for k, meta in enumerate(sd["partitions"]):
            if int(meta["group_index"]) >= 0 and states.get(k):
                sources.setdefault(int(meta["group_index"]), []).append((rank, k, states[k]))
    state: dict[int, dict[str, Any]] = {}
    for k, tile in enumerate(opt.tiles):
        present = sources.get(tile.group_index)
        if not present:
            continue
        r0, k0, template = present[0]
        old_numel = int(sds[r0]["partitions"][k0]["numel"])
        new: dict[str, Any] = {}
        for key, value in template.items():
            if is_partition_shaped(value, old_numel):
                dst = torch.empty(tile.numel, dtype=value.dtype)
                fill_partition(
                    dst,
                    tile.fragments(),
                    index,
                    lambda rank, kk, key=key: sds[rank]["base_optimizer_state"]["state"][kk][key],
                )
                new[key] = dst
            else:
                new[key] = value.clone() if isinstance(value, torch.Tensor) else value
        state[k] = new
    ids: list[list[int]] = [[] for _ in groups]
    for k, tile in enumerate(opt.tiles):
        ids[tile.group_index].append(k)
    # Saved hyper-parameters win; keys only this optimizer has (another optimizer class saved it) stay.
    loaded = [
        {**{key: v for key, v in {**groups[g], **saved}.items() if key != "params"}, "params": ids[g]}
        for g, saved in enumerate(saved_groups)
    ]
    opt.optimizer.load_state_dict({"state": state, "param_groups": loaded})
    if opt.optimizer_swapper is not None:
        opt.optimizer_swapper.adopt_state()
    opt._placement.adopt_state()  # partial offload: device tiles' state back on the accelerator


def consolidated_16bit_state_dict(
    module: nn.Module, *, rank0_only: bool = True, exclude_frozen_parameters: bool = False
) -> dict[str, Any]:
    """The full state_dict of a stage-3 model (parameters in their training dtype, buffers as they are).

    Gathers one module's parameters at a time (`GatheredParameters`), so no rank ever holds more than one
    module's full parameters on the device; the result is assembled on the CPU. This is what
    `engine.save_16bit_model()` writes under `stage3_gather_16bit_weights_on_model_save`.

    Every rank must call it (collectives per module). Keys and order are those of `module.state_dict()`.
    Refused (NotImplementedError) for a model with AutoEP experts partitioned over their own groups.

    Args:
        module: the stage-3 model.
        rank0_only: only global rank 0 assembles (and returns) the dict; the others return `{}`.
        exclude_frozen_parameters: leave out parameters with `requires_grad=False`.
    """
    if has_families(p for p in module.parameters() if is_zero_param(p)):
        raise NotImplementedError(
            "a consolidated 16-bit state_dict (save_16bit_model, stage3_gather_16bit_weights_on_model_save) is not "
            "supported for AutoEP at ZeRO stage 3, as in DeepSpeed: the expert parameters are partitioned over their "
            "expert-data-parallel groups, so a data-parallel consolidation would hold only some experts; "
            "convert a save_checkpoint() with ds_to_universal.py (it joins every expert tensor whole)"
        )
    keep = not rank0_only or ds_comm.get_rank() == 0
    template = module.state_dict(keep_vars=True)
    gathered: dict[int, torch.Tensor | None] = {}
    values: dict[str, Any] = {}
    for mod_name, m in module.named_modules(remove_duplicate=False):
        own = [(n, p) for n, p in m._parameters.items() if is_zero_param(p)]
        need = [p for _, p in own if id(p) not in gathered]
        if need:
            with GatheredParameters(need):
                for p in need:
                    gathered[id(p)] = p.data.detach().to("cpu", copy=True) if keep else None
        prefix = f"{mod_name}." if mod_name else ""
        for n, p in own:
            values[prefix + n] = (gathered[id(p)], p.requires_grad)
    if not keep:
        return {}
    out: dict[str, Any] = OrderedDict()
    for key, value in template.items():
        if key in values:
            tensor, trainable = values[key]
            if exclude_frozen_parameters and not trainable:
                continue
            out[key] = tensor
        elif isinstance(value, nn.Parameter) and exclude_frozen_parameters and not value.requires_grad:
            continue
        elif isinstance(value, torch.Tensor):
            out[key] = value.detach().to("cpu", copy=True)
        else:
            out[key] = value
    return out
