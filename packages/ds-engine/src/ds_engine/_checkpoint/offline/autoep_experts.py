"""AutoEP expert weights of a checkpoint, rejoined into whole `[num_experts, ...]` tensors (universal format).

A checkpoint keeps one file per (MoE layer, global expert), `layer_{L}_expert_{E}_mp_rank_{XX}_model_states.pt`,
holding row E of each stacked expert tensor under `<prefix>.<w>.<E>`. Rejoining stacks the rows of experts
0 .. E-1 into DeepSpeed's universal expert entry `{param, cat_dim: 0, is_expert_param, ep_num_experts}` under
`<output>/zero/<prefix>.<w>/fp32.pt`, so a universal load can cut it at any expert-parallel degree.

ds writes each expert once per tensor-parallel rank that holds it: once in a folded AutoEP+AutoTP run whose
`autoep_size` is a multiple of `autotp_size` (the mp_rank in the name varies), and once at each such rank when
`autoep_size` is below `autotp_size` (the expert's data-parallel replicas sit at several tensor-parallel
ranks, and each rank loads its own file). Several files from distinct expert-data-parallel ranks holding the
same values are those replicas and are read as one; others (DeepSpeed's folded expert shards, one per
tensor-parallel rank of one replica) are refused, as DeepSpeed refuses them. The folding record travels with
the entry.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from typing import Any

import torch

import ds_comm
from ds_engine._checkpoint.constants import (
    CAT_DIM,
    EP_IS_EXPERT_PARAM,
    EP_NUM_EXPERTS,
    FOLDING_METADATA_KEY,
    FOLDING_ZERO_PARTITION_RANK,
    PARAM,
)

__all__ = ["consolidate_autoep_expert_files", "resolve_expert_ckpt_path"]

_WEIGHTS = ("w1", "w2", "w3")


def resolve_expert_ckpt_path(checkpoint_dir: str, moe_layer_id: int, global_expert_id: int) -> str:
    """The one file of expert `global_expert_id` of MoE layer `moe_layer_id`, whatever its mp_rank.

    Raises:
        FileNotFoundError: no such file.
        NotImplementedError: several files (one per model-parallel rank): folded expert shards, or multi-mp_rank.
    """
    pattern = os.path.join(checkpoint_dir, f"layer_{moe_layer_id}_expert_{global_expert_id}_mp_rank_*_model_states.pt")
    matches = sorted(glob.glob(pattern))
    if not matches:
        raise FileNotFoundError(
            f"Expert checkpoint file not found: layer_{moe_layer_id} expert_{global_expert_id} in {checkpoint_dir}"
        )
    if len(matches) > 1:
        if any(FOLDING_METADATA_KEY in ds_comm.load_checkpoint_file(path) for path in matches):
            raise NotImplementedError(
                "Universal checkpoint conversion for folded AutoEP+AutoTP expert shards is not supported: "
                f"{len(matches)} files hold layer_{moe_layer_id} expert_{global_expert_id}; load this checkpoint "
                "with the same folded topology instead"
            )
        raise NotImplementedError(
            f"Multiple expert checkpoint files found for layer_{moe_layer_id} expert_{global_expert_id}: {matches}"
        )
    return matches[0]


def _expert_file(checkpoint_dir: str, moe_layer_id: int, global_expert_id: int) -> dict[str, Any]:
    """The saved entries of one expert: its one file, or its replicas' files when they hold the same values.

    Raises:
        FileNotFoundError / NotImplementedError: as `resolve_expert_ckpt_path` (the latter for files that differ).
    """
    try:
        return ds_comm.load_checkpoint_file(resolve_expert_ckpt_path(checkpoint_dir, moe_layer_id, global_expert_id))  # type: ignore[no-any-return]
    except NotImplementedError:
        pattern = f"layer_{moe_layer_id}_expert_{global_expert_id}_mp_rank_*_model_states.pt"
        saved = [
            ds_comm.load_checkpoint_file(path) for path in sorted(glob.glob(os.path.join(checkpoint_dir, pattern)))
        ]
        if _replicas(saved):
            return saved[0]  # type: ignore[no-any-return]
        raise


def _replicas(saved: list[dict[str, Any]]) -> bool:
    """Whether the files are one expert's data-parallel replicas: folded records of distinct
    expert-data-parallel ranks (shards of one replica share it), holding the same values."""
    if not all(FOLDING_METADATA_KEY in s for s in saved):
        return False
    ranks = [s[FOLDING_METADATA_KEY].get(FOLDING_ZERO_PARTITION_RANK) for s in saved]
    return len(set(ranks)) == len(ranks) and all(_same_tensors(saved[0], s) for s in saved[1:])


def _same_tensors(a: dict[str, Any], b: dict[str, Any]) -> bool:
    tensors_a = {k: v for k, v in a.items() if isinstance(v, torch.Tensor)}
    tensors_b = {k: v for k, v in b.items() if isinstance(v, torch.Tensor)}
    return tensors_a.keys() == tensors_b.keys() and all(torch.equal(v, tensors_b[k]) for k, v in tensors_a.items())


def consolidate_autoep_expert_files(
    checkpoint_dir: str, output_dir: str, autoep_layers_metadata: Sequence[dict[str, Any]] | None
) -> None:
    """Write each AutoEP layer's whole expert tensors in universal format (see the module docstring).

    Args:
        autoep_layers_metadata: the model-states file's `ds_autoep_layers` entries (`moe_layer_id`,
            `num_experts`, `expert_key_prefix` are read).

    Raises:
        RuntimeError: the entries are missing or not a list, or an expert file lacks its row.
        FileNotFoundError / NotImplementedError: see `resolve_expert_ckpt_path`.
    """
    if autoep_layers_metadata is None:
        raise RuntimeError("AutoEP metadata (ds_autoep_layers) is missing from the checkpoint; cannot rejoin experts")
    if not isinstance(autoep_layers_metadata, list):
        raise RuntimeError(
            f"AutoEP metadata is malformed: expected a list, got {type(autoep_layers_metadata).__name__}"
        )
    for layer in autoep_layers_metadata:
        layer_id, num_experts, prefix = layer["moe_layer_id"], layer["num_experts"], layer["expert_key_prefix"]
        files = [_expert_file(checkpoint_dir, layer_id, e) for e in range(num_experts)]
        for weight in _WEIGHTS:
            rows = []
            for expert, saved in enumerate(files):
                key = f"{prefix}.{weight}.{expert}"
                if key not in saved:
                    raise RuntimeError(f"expert file of layer_{layer_id} expert_{expert} has no entry {key!r}")
                rows.append(saved[key])
            entry: dict[str, Any] = {
                PARAM: torch.stack(rows),
                CAT_DIM: 0,
                EP_IS_EXPERT_PARAM: True,
                EP_NUM_EXPERTS: num_experts,
            }
            if FOLDING_METADATA_KEY in files[0]:
                entry[FOLDING_METADATA_KEY] = files[0][FOLDING_METADATA_KEY]
            target = os.path.join(output_dir, "zero", f"{prefix}.{weight}")
            os.makedirs(target, exist_ok=True)
            torch.save(entry, os.path.join(target, "fp32.pt"))
