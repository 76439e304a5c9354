"""Rejoining AutoEP expert files for the universal format when an expert has several files.

A folded run with `autoep_size` below `autotp_size` writes each expert once per tensor-parallel rank holding
it (its expert-data-parallel replicas: distinct `zero_partition_rank`, the same values); those are one expert.
Several files of one replica (DeepSpeed's folded expert shards: one `zero_partition_rank`, per tensor-parallel
rank) are refused as DeepSpeed refuses them, and so are replicas whose values differ.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ds_engine.checkpoint.autoep_universal import consolidate_autoep_expert_files

LAYER = [{"moe_layer_id": 0, "num_experts": 1, "expert_key_prefix": "experts"}]


def _write(folder: Path, tp_rank: int, edp_rank: int, value: float) -> None:
    record = {"family": "routed_expert", "tp_rank": tp_rank, "zero_partition_rank": edp_rank}
    tensors = {f"experts.{w}.0": torch.full((2, 3), value) for w in ("w1", "w2", "w3")}
    torch.save({"folding": record, **tensors}, folder / f"layer_0_expert_0_mp_rank_{tp_rank:02d}_model_states.pt")


def test_replicas_at_two_tensor_parallel_ranks_are_one_expert(tmp_path: Path) -> None:
    _write(tmp_path, tp_rank=0, edp_rank=0, value=1.5)
    _write(tmp_path, tp_rank=2, edp_rank=1, value=1.5)
    consolidate_autoep_expert_files(str(tmp_path), str(tmp_path / "universal"), LAYER)
    entry = torch.load(tmp_path / "universal" / "zero" / "experts.w1" / "fp32.pt")
    torch.testing.assert_close(entry["param"], torch.full((1, 2, 3), 1.5))


def test_shards_of_one_replica_are_refused_even_when_equal(tmp_path: Path) -> None:
    _write(tmp_path, tp_rank=0, edp_rank=0, value=1.0)
    _write(tmp_path, tp_rank=1, edp_rank=0, value=1.0)
    with pytest.raises(NotImplementedError, match="folded AutoEP\\+AutoTP expert shards"):
        consolidate_autoep_expert_files(str(tmp_path), str(tmp_path / "universal"), LAYER)


def test_replicas_that_differ_are_refused(tmp_path: Path) -> None:
    _write(tmp_path, tp_rank=0, edp_rank=0, value=1.0)
    _write(tmp_path, tp_rank=2, edp_rank=1, value=2.0)
    with pytest.raises(NotImplementedError, match="folded AutoEP\\+AutoTP expert shards"):
        consolidate_autoep_expert_files(str(tmp_path), str(tmp_path / "universal"), LAYER)
