"""The universal checkpoint of an AutoEP save: every expert tensor whole, `[num_experts, ...]`, whatever the layout.

An AutoEP layer stacks its local experts in `experts.w1/w2/w3` (`[num_local_experts, ...]`): expert-parallel
rank e holds experts `[e * local, (e + 1) * local)`, replicated over its expert-data-parallel group and (ZeRO)
partitioned over that group only. ds saves such a tensor's ZeRO fragments under a name that says which
experts it holds, `<prefix>.w1@experts{lo}:{hi}` (`ds_engine._step.moe`), at every stage; so the fragments of
all ranks of one save rebuild each expert range whole (`FragmentIndex`), whatever partitioned them.

`write_autoep_universal` writes DeepSpeed 0.19.8's universal layout from that:

* an expert tensor: the ranges of every expert-parallel rank joined along dim 0 (they must tile
  `[0, num_experts)`), one file per state, `{"param": whole, "cat_dim": 0, "is_expert_param": True,
  "ep_num_experts": num_experts}` in `zero/<prefix>.w1/` (DeepSpeed's names: the module's, without the range);
* every other parameter as its ZeRO stage's universal files: stage 3 the bare flat tensor (`fp32.pt` requiring
  grad), stage 1/2 `{"cat_dim": 0, "param": full}`, plus `step.pt`;
* `zero/optimizer_state.pt`: the save's common state (rank 0's minus the partitions) with `param_groups`, and
  at stage 3 DeepSpeed's `optimizer_state_dict` whose `state[0]["step"]` is the step;
* the model-states file, its `param_shapes` rewritten to the universal names and whole shapes, with
  DeepSpeed's `universal_checkpoint_info` (`expert_parameter_patterns`, `ds_autoep_layers`).

A universal load cuts each expert tensor for the loading expert-parallel rank, so the checkpoint loads at any
data-parallel world size and any `autoep_size` that divides `num_experts`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

import ds_comm
from ds_comm.checkpoint_files import deepspeed_pickle_names
from ds_zero._checkpoint.expert_ranges import expert_range
from ds_zero._checkpoint.format import FragmentIndex, full_param_states
from ds_zero._checkpoint.partition_files import load_partition_state_dicts

__all__ = ["AUTOEP_LAYERS_KEYS", "autoep_layers", "expert_range", "write_autoep_universal"]

logger = logging.getLogger(__name__)

AUTOEP_LAYERS_KEYS = ("ds_autoep_layers", "autoep_layers")
_SHARDED = ("base_optimizer_state", "single_partition_of_fp32_groups", "fp32_flat_groups", "partitions")
_EXPERT_PATTERN = r".*\.experts\.w[123]$"  # DeepSpeed's `expert_parameter_patterns` entry for AutoEP


def autoep_layers(states: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The model-states dict's AutoEP layer entries (DeepSpeed's key, or ds's older one); `[]` without AutoEP."""
    for key in AUTOEP_LAYERS_KEYS:
        entries = states.get(key)
        if entries:
            return [e for e in entries if isinstance(e, Mapping)]
    return []


def _num_experts(layers: Sequence[Mapping[str, Any]], base: str) -> int:
    for entry in layers:
        prefix = entry.get("expert_key_prefix")
        if prefix and base.rsplit(".", 1)[0] == prefix:
            return int(entry["num_experts"])
    raise ValueError(f"expert parameter {base!r} belongs to no AutoEP layer of ds_autoep_layers")


def _join(base: str, ranges: list[tuple[int, int, dict[str, Any]]], num_experts: int) -> dict[str, torch.Tensor]:
    """The whole `[num_experts, ...]` tensor of every state of expert parameter `base`, from its ranges."""
    ranges.sort(key=lambda r: r[0])
    at = 0
    for lo, hi, _ in ranges:
        if lo != at:
            break
        at = hi
    if at != num_experts or len({hi - lo for lo, hi, _ in ranges}) != 1:
        got = [(lo, hi) for lo, hi, _ in ranges]
        raise ValueError(
            f"AutoEP expert parameter {base!r}: the saved expert ranges {got} do not tile its {num_experts} experts "
            "evenly; a rank's optimizer-state file is missing, or the save mixes expert-parallel layouts"
        )
    keys = [k for k, v in ranges[0][2].items() if isinstance(v, torch.Tensor) and v.dim() == 1 and k != "step"]
    return {key: torch.cat([states[key] for _, _, states in ranges]) for key in keys}


def write_autoep_universal(src: Path, out: Path, states_file: Path, states: Mapping[str, Any]) -> None:
    """Write the universal checkpoint of the AutoEP save in tag directory `src` into `out` (module docstring).

    Args:
        src: the tag directory (ds's layout: format-1 optimizer files and one model-states file per
            model-parallel rank; DeepSpeed's files are read too).
        out: the universal checkpoint's folder (`zero/` is created in it).
        states_file / states: the save's model-states file and its contents (with `ds_autoep_layers`).

    Raises:
        ValueError: expert ranges that do not tile an expert tensor, an expert tensor of no AutoEP layer, or
            a tensor-parallel (folded) save.
    """
    layers = autoep_layers(states)
    dims = states.get("checkpoint_parallel_dimensions") or {}
    if int(dims.get("tp_degree", 1) or 1) > 1 or len(list(src.glob("*mp_rank_01*"))) > 0:
        raise ValueError(
            f"{src}: universal conversion of an AutoEP checkpoint folded with tensor parallelism is not supported "
            "(as in DeepSpeed); load it with the same topology"
        )
    parts = load_partition_state_dicts(src)
    index = FragmentIndex(parts)
    stage = int(parts[0]["zero_stage"])
    zero = out / "zero"
    zero.mkdir(parents=True, exist_ok=True)
    experts: dict[str, list[tuple[int, int, dict[str, Any]]]] = {}
    whole_shapes: dict[str, list[int]] = {}
    step: Any = None
    for name in index.names:
        full = full_param_states(index, parts, name)
        step = full.pop("step", step)
        shape = list(index.param_shapes[name])
        found = expert_range(name)
        if found is not None:
            base, lo, hi = found
            experts.setdefault(base, []).append((lo, hi, full))
            whole_shapes.setdefault(base, shape)
            continue
        whole_shapes[name] = shape
        _write_states(zero / name, full, shape, stage, step, expert_count=None)
    prefixes = {f"{e.get('expert_key_prefix')}." for e in layers}
    unranged = [n for n in whole_shapes if n not in experts and any(n.startswith(p) for p in prefixes)]
    if unranged:
        raise ValueError(
            f"{src}: AutoEP expert parameters {unranged[:3]} are saved without their expert range (a save by "
            "DeepSpeed, or by an older ds): their ranks' fragments cannot be told apart; convert a ds save"
        )
    for base, ranges in experts.items():
        num_experts = _num_experts(layers, base)
        joined = _join(base, ranges, num_experts)
        whole_shapes[base] = [num_experts, *whole_shapes[base][1:]]
        _write_states(zero / base, joined, whole_shapes[base], stage, step, expert_count=num_experts)
    _write_common(zero, parts[0], stage, step)
    _write_model_states(states, states_file, out, whole_shapes, layers)
    logger.info("AutoEP universal checkpoint: %d expert tensors joined into %s", len(experts), out)


def _write_states(
    folder: Path, full: Mapping[str, Any], shape: list[int], stage: int, step: Any, *, expert_count: int | None
) -> None:
    folder.mkdir(exist_ok=True)
    for key, value in full.items():
        if not isinstance(value, torch.Tensor):
            continue
        tensor = value.detach().clone().requires_grad_(key == "fp32")  # as DeepSpeed's: its fp32 masters need grad
        payload: Any
        if expert_count is not None:
            payload = {
                "param": tensor.view(shape),
                "cat_dim": 0,
                "is_expert_param": True,
                "ep_num_experts": expert_count,
            }
        elif stage == 3:
            payload = tensor
        else:
            payload = {"cat_dim": 0, "param": tensor.view(shape)}
        ds_comm.atomic_save(payload, folder / f"{key}.pt")
    if stage < 3 and step is not None:
        ds_comm.atomic_save(step, folder / "step.pt")


def _write_common(zero: Path, rank0: Mapping[str, Any], stage: int, step: Any) -> None:
    """`optimizer_state.pt`: the save's global state (see the module docstring)."""
    common = {k: v for k, v in rank0.items() if k not in _SHARDED}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in rank0["base_optimizer_state"]["param_groups"]]
    common["param_groups"] = groups
    if stage == 3:  # DeepSpeed's stage-3 common file keeps the base optimizer's step
        common["optimizer_state_dict"] = {"state": {0: {"step": step}}, "param_groups": groups}
    with deepspeed_pickle_names():
        ds_comm.atomic_save(common, zero / "optimizer_state.pt")


def _write_model_states(
    states: Mapping[str, Any],
    states_file: Path,
    out: Path,
    whole_shapes: Mapping[str, list[int]],
    layers: Sequence[Mapping[str, Any]],
) -> None:
    copied = dict(states)
    shapes = []
    for group in states.get("param_shapes") or []:
        names: dict[str, torch.Size] = {}
        for name in group:
            found = expert_range(name)
            base = found[0] if found is not None else name
            names[base] = torch.Size(whole_shapes.get(base, group[name]))
        shapes.append(names)
    copied["param_shapes"] = shapes
    info = dict(states.get("universal_checkpoint_info") or {})
    info["expert_parameter_patterns"] = [_EXPERT_PATTERN]
    info["ds_autoep_layers"] = [dict(e) for e in layers]
    copied["universal_checkpoint_info"] = info
    with deepspeed_pickle_names():
        ds_comm.atomic_save(copied, out / states_file.name)
