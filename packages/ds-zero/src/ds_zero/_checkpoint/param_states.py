"""A ZeRO 1/2 save in per-parameter form, and back: for callers that change parameters' shapes between runs.

[Note: why a per-parameter form] The partition files locate every parameter by name and flat offset, so
they load at any data-parallel size, but only into parameters of the saved shapes. A caller that cuts
parameters differently in the next run (tensor parallelism at another degree) needs each parameter's
whole fp32 master and optimizer state as tensors of the parameter's shape: it re-cuts them, and
`partitions_from_param_states` turns the result into a single-rank save that `load_state_dict`
re-partitions onto any world size.

The form (plain types and tensors, so it can be saved with `weights_only` loading):
    {"zero_stage": int, "model_dtype": str,
     "groups": [{"names": [...], "hyper": {lr, betas, ...}, "step": value or None, "keys": [state keys]}],
     "params": {name: {"fp32": tensor, <key>: tensor, ...}},   # each of the parameter's shape
     "loss_scaler": dict, "dynamic_loss_scale": bool, "overflow": bool, "clip_grad": float,
     "shared_params": dict, "frozen_param_shapes": dict}
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ds_zero._checkpoint.format import FORMAT_VERSION, FragmentIndex, is_partition_shaped, partition_metadata
from ds_zero._partition import Fragment

__all__ = ["param_states_from_partitions", "param_states_of", "partitions_from_param_states"]

_COMMON = ("loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad", "shared_params", "frozen_param_shapes")


def _hyper(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def param_states_of(
    optimizer: Any,
    *,
    transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
    keep_tensors: bool = True,
) -> dict[str, Any]:
    """The per-parameter form of a live `DeepSpeedZeroOptimizer` (stages 1/2).

    Collective: one all-reduce per parameter and state over its partition group (every rank of the
    data-parallel group calls it, in the same order); every rank gets the whole form.

    Args:
        optimizer: the ZeRO optimizer.
        transform: applied to each tensor as `transform(name, tensor)` right after it is assembled, in the
            same order on every rank (a caller's own collective, e.g. gathering a tensor-parallel shard).
        keep_tensors: False drops each tensor once transformed (`params` is then empty): for the ranks
            that take part in the collectives but write nothing, so they never hold the whole state.

    Raises:
        TypeError: a stage-3 optimizer (its partitions hold sub-groups; not supported here).
    """
    if not hasattr(optimizer, "flats"):
        raise TypeError(f"param_states_of takes a stage 1/2 DeepSpeedZeroOptimizer, got {type(optimizer).__name__}")
    base = optimizer.optimizer
    groups, params = [], {}
    for flat, master, group in zip(optimizer.flats, optimizer.masters, base.param_groups, strict=True):
        state = base.state.get(master, {})
        keys = [k for k, v in state.items() if is_partition_shaped(v, master.numel())]
        names = [slot.name for slot in flat.slots]
        step = state.get("step")
        step = step.detach().clone() if isinstance(step, torch.Tensor) else step  # a snapshot, not the live counter
        groups.append({"names": names, "hyper": _hyper(group), "step": step, "keys": keys})
        for p, name in zip(flat.params, names, strict=True):
            entry = {}
            for key in ["fp32", *keys]:
                value = optimizer.get_full_hp_param(p, None if key == "fp32" else key)
                if transform is not None:
                    value = transform(name, value)
                entry[key] = value.cpu()
            if keep_tensors:
                params[name] = entry
    dtype = next((f.dtype for f in optimizer.flats if f.numel), torch.float32)
    return {
        "zero_stage": int(optimizer.zero_stage),
        "model_dtype": str(dtype).removeprefix("torch."),
        "groups": groups,
        "params": params,
        "loss_scaler": optimizer.loss_scaler.state_dict(),
        "dynamic_loss_scale": bool(optimizer.loss_scaler.dynamic),
        "overflow": bool(optimizer.overflow),
        "clip_grad": float(optimizer.clip_grad),
        "shared_params": dict(optimizer.shared_params),
        "frozen_param_shapes": dict(optimizer.frozen_param_shapes),
    }


def param_states_from_partitions(state_dicts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The per-parameter form of a stage 1/2 save, from every saved rank's state dict (rank order).

    Raises:
        ValueError: missing ranks or fragments (names the parameter), or a stage-3 save.
    """
    index = FragmentIndex(state_dicts)
    first = state_dicts[0]
    if int(first["zero_stage"]) == 3:
        raise ValueError("param_states_from_partitions reads stage 1/2 saves; this one is stage 3")
    base = first["base_optimizer_state"]
    names_of: dict[int, list[str]] = {}
    for sd in state_dicts:
        for meta in sd["partitions"]:
            names = names_of.setdefault(int(meta["group_index"]), [])
            names.extend(n for n in (Fragment.from_list(f).name for f in meta["fragments"]) if n not in names)
    groups, params = [], {}
    for g, hyper in enumerate(base["param_groups"]):
        names = names_of.get(g, [])
        keys: list[str] = []
        step = None
        for sd in state_dicts:
            state = sd["base_optimizer_state"]["state"].get(g, {})
            numel = int(sd["partitions"][g]["numel"])
            keys = keys or [k for k, v in state.items() if is_partition_shaped(v, numel)]
            step = state.get("step", step)
        groups.append({"names": names, "hyper": _hyper(hyper), "step": step, "keys": keys})
        for name in names:
            index.check_complete(name)
            shape = index.param_shapes[name]
            entry = {}
            for key in ["fp32", *keys]:
                dtype = torch.float32
                if key != "fp32":
                    dtype = next(
                        sd["base_optimizer_state"]["state"][g][key].dtype
                        for sd in state_dicts
                        if key in sd["base_optimizer_state"]["state"].get(g, {})
                    )
                out = torch.empty(math.prod(shape), dtype=dtype)
                if key == "fp32":
                    index.copy_slice(out, name, 0, lambda r, k: state_dicts[r]["single_partition_of_fp32_groups"][k])
                else:
                    index.copy_slice(
                        out, name, 0, lambda r, k, key=key: state_dicts[r]["base_optimizer_state"]["state"][k][key]
                    )
                entry[key] = out.view(shape)
            params[name] = entry
    return {
        "zero_stage": int(first["zero_stage"]),
        "model_dtype": str(first.get("model_dtype", "float32")),
        "groups": groups,
        "params": params,
        **{k: first.get(k) for k in _COMMON},
    }


def partitions_from_param_states(states: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A single-rank save (format 1) holding `states`, which `load_state_dict` re-partitions.

    Raises:
        ValueError: a parameter lacks a state its group lists, or shapes within an entry disagree.
    """
    fp32, metas, base_state, hyper = [], [], {}, []
    for g, group in enumerate(states["groups"]):
        flats: dict[str, list[torch.Tensor]] = {key: [] for key in ["fp32", *group["keys"]]}
        frags, shapes, at = [], {}, 0
        for name in group["names"]:
            entry = states["params"][name]
            shape = tuple(entry["fp32"].shape)
            for key, parts in flats.items():
                if key not in entry or tuple(entry[key].shape) != shape:
                    raise ValueError(f"parameter {name!r}: state {key!r} is missing or not of its shape {shape}")
                parts.append(entry[key].reshape(-1))
            numel = math.prod(shape)
            frags.append(Fragment(name, 0, numel, at))
            shapes[name] = list(shape)
            at += numel
        fp32.append(torch.cat(flats.pop("fp32")).float() if at else torch.zeros(0))
        metas.append(partition_metadata(g, at, frags, shapes))
        state: dict[str, Any] = {key: torch.cat(parts) for key, parts in flats.items() if parts}
        if group.get("step") is not None:
            state = {"step": group["step"], **state}
        base_state[g] = state
        hyper.append({**group["hyper"], "params": [g]})
    return [
        {
            "ds_zero_format": FORMAT_VERSION,
            "zero_stage": int(states["zero_stage"]),
            "partition_count": 1,
            "dp_rank": 0,
            "model_dtype": states.get("model_dtype", "float32"),
            "offload_optimizer": "none",
            "single_partition_of_fp32_groups": fp32,
            "partitions": metas,
            "base_optimizer_state": {"state": base_state, "param_groups": hyper},
            "loss_scaler": states.get("loss_scaler") or {"cur_scale": 1.0, "dynamic": False},
            "dynamic_loss_scale": bool(states.get("dynamic_loss_scale", False)),
            "overflow": bool(states.get("overflow", False)),
            "clip_grad": float(states.get("clip_grad") or 0.0),
            "shared_params": dict(states.get("shared_params") or {}),
            "frozen_param_shapes": dict(states.get("frozen_param_shapes") or {}),
        }
    ]
