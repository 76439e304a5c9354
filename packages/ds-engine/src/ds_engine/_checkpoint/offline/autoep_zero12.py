"""AutoEP expert optimizer states of a ZeRO-1/2 checkpoint, rejoined into whole `[num_experts, ...]` tensors.

A universal conversion first cuts every rank's flat ZeRO-1/2 partition into per-parameter fragments, one file per
(parameter, state, data-parallel rank): `<temp>/<param>/0/<state>.<dp_rank:02d>` (DeepSpeed's layout). An AutoEP
expert parameter is not one tensor across the data-parallel world: each expert-parallel rank holds its own
`num_local_experts`, partitioned over its expert-data-parallel group. So the fragments of expert-parallel rank e
are those of the data-parallel ranks in e's group, in group order, and the whole parameter is the local tensors of
e = 0, 1, ... stacked along dim 0. Which data-parallel ranks form e's group depends on the rank layout:
expert-parallel innermost (DeepSpeed's default, "E+D": ranks e, e + ep, e + 2*ep, ...) or data-parallel innermost
(`use_data_before_expert_parallel_`, "D+E": ranks e*edp ... (e+1)*edp - 1).

Each state is saved as DeepSpeed's universal expert entry (`{param, cat_dim: 0, is_expert_param: True,
ep_num_experts}`) under `<output>/zero/<param>/<state>.pt`, and the optimizer step (equal on every rank) as
`step.pt`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ds_engine._checkpoint.constants import CAT_DIM, EP_IS_EXPERT_PARAM, EP_NUM_EXPERTS, PARAM

__all__ = ["autoep_zero12_dp_ranks", "consolidate_autoep_zero12_expert_states", "zero12_fragment_path"]

logger = logging.getLogger(__name__)

_STATES = ("fp32", "exp_avg", "exp_avg_sq")


def zero12_fragment_path(temp_dir: str, param_name: str, state_name: str, dp_rank: int) -> str:
    """The file of one (parameter, state, data-parallel rank) fragment in a conversion's temporary folder."""
    return os.path.join(temp_dir, param_name, "0", f"{state_name}.{dp_rank:02d}")


def autoep_zero12_dp_ranks(ep_rank: int, dp_degree: int, ep_size: int, data_before_expert: bool) -> range:
    """The data-parallel ranks (in order) whose fragments make up expert-parallel rank `ep_rank`'s experts.

    Raises:
        ValueError: `ep_size` does not divide `dp_degree`.
    """
    if dp_degree % ep_size:
        raise ValueError(f"the ZeRO data-parallel degree {dp_degree} is not divisible by autoep_size {ep_size}")
    if data_before_expert:
        edp = dp_degree // ep_size
        return range(ep_rank * edp, (ep_rank + 1) * edp)
    return range(ep_rank, dp_degree, ep_size)


def _local_state(temp_dir: str, name: str, state: str, ranks: range, shape: tuple[int, ...]) -> torch.Tensor:
    parts = []
    for dp_rank in ranks:
        path = zero12_fragment_path(temp_dir, name, state, dp_rank)
        if not os.path.isfile(path):
            continue  # a rank whose partition holds none of this parameter
        part = torch.load(path, map_location="cpu", weights_only=False)
        if not torch.is_tensor(part) or part.dtype != torch.float32:
            raise RuntimeError(
                f"AutoEP {state} fragment {path} must be an fp32 tensor, got {getattr(part, 'dtype', part)}"
            )
        parts.append(part.flatten())
    numel = torch.Size(shape).numel()
    got = sum(p.numel() for p in parts)
    if got != numel:
        raise RuntimeError(
            f"AutoEP {state} fragments of {name} on data-parallel ranks {list(ranks)} hold {got} elements, "
            f"expected {numel} (local shape {shape})"
        )
    return torch.cat(parts).view(shape)


def consolidate_autoep_zero12_expert_states(
    temp_dir: str,
    output_dir: str,
    expert_param_info: Mapping[str, Mapping[str, Any]],
    slice_shapes: Mapping[str, Sequence[int]],
    dp_degree: int,
    tp_degree: int,
    use_data_before_expert_parallel: bool,
) -> None:
    """Rejoin every AutoEP expert parameter's fp32 weights and Adam moments, and save its step.

    Args:
        temp_dir: the conversion's fragment folder (see `zero12_fragment_path`).
        output_dir: the universal checkpoint folder (states go under `zero/<param>/`).
        expert_param_info: parameter name -> its layer's `num_experts`, `num_local_experts`, `ep_size`.
        slice_shapes: parameter name -> its local (one expert-parallel rank's) shape.
        dp_degree / tp_degree: the checkpoint's ZeRO data-parallel and tensor-parallel degrees.
        use_data_before_expert_parallel: the saving run's rank layout (see the module docstring).

    Raises:
        NotImplementedError: tensor parallelism, or a non-contiguous expert placement.
        RuntimeError: a missing or mis-sized fragment, a local shape that disagrees with the metadata, or steps that
            differ between ranks.
    """
    if tp_degree != 1:
        raise NotImplementedError("AutoEP ZeRO-1/2 universal conversion with tensor parallelism is not supported")
    for name, info in expert_param_info.items():
        if info.get("expert_placement") is not None:
            raise NotImplementedError(f"{name}: AutoEP expert_placement other than contiguous is not supported")
        if name not in slice_shapes:
            raise RuntimeError(f"AutoEP expert parameter {name} is missing from the checkpoint's parameter shapes")
        shape = tuple(int(d) for d in slice_shapes[name])
        ep_size, num_experts = int(info["ep_size"]), int(info["num_experts"])
        if not shape or shape[0] != info["num_local_experts"] or shape[0] * ep_size != num_experts:
            raise RuntimeError(
                f"AutoEP local shape {shape} of {name} disagrees with num_local_experts={info['num_local_experts']}, "
                f"ep_size={ep_size}, num_experts={num_experts}"
            )
        out = os.path.join(output_dir, "zero", name)
        os.makedirs(out, exist_ok=True)
        for state in _STATES:
            ranks = [
                autoep_zero12_dp_ranks(e, dp_degree, ep_size, use_data_before_expert_parallel) for e in range(ep_size)
            ]
            full = torch.cat([_local_state(temp_dir, name, state, r, shape) for r in ranks])
            entry = {PARAM: full, CAT_DIM: 0, EP_IS_EXPERT_PARAM: True, EP_NUM_EXPERTS: num_experts}
            torch.save(entry, os.path.join(out, f"{state}.pt"))
        steps = [
            torch.load(p, map_location="cpu", weights_only=False)
            for p in (zero12_fragment_path(temp_dir, name, "step", r) for r in range(dp_degree))
            if os.path.isfile(p)
        ]
        if not steps:
            raise RuntimeError(f"AutoEP optimizer step of {name} is missing")
        if any(not torch.equal(torch.as_tensor(s), torch.as_tensor(steps[0])) for s in steps[1:]):
            raise RuntimeError(f"AutoEP optimizer steps of {name} differ between data-parallel ranks: {steps}")
        torch.save(steps[0], os.path.join(out, "step.pt"))
