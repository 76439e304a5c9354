"""`deepspeed.module_inject.tp_shard`: DeepSpeed's split-size helpers over ds-parallel's rules."""

from __future__ import annotations

import pytest

pytest.importorskip("ds_parallel", reason="tp_shard needs ds-parallel: pip install 'ds-engine[parallel]'")

from ds_engine.module_inject.tp_shard import AutoTPMeta, get_shard_size, get_shard_size_list  # noqa: E402


def test_heads_split_whole_and_mlp_split_by_grain() -> None:
    meta = AutoTPMeta(num_kv_heads=5, tp_grain_size=8)
    # 5 kv heads of 16 over 2 ranks: 3 heads, then 2
    assert get_shard_size_list(80, 2, meta, "layers.0.self_attn.k_proj") == [48, 32]
    # MLP: whole grains of 8 (12 of them) shared 6/6, the 4-element tail goes to the last rank
    assert get_shard_size_list(100, 2, meta, "layers.0.mlp.up_proj") == [48, 52]
    assert [get_shard_size(100, 2, meta, "layers.0.mlp.up_proj", rank=r) for r in (0, 1)] == [48, 52]


def test_default_meta_splits_near_evenly_without_a_name() -> None:
    assert get_shard_size_list(7, 3, AutoTPMeta()) == [3, 2, 2]


def test_rank_defaults_to_the_world_only_when_it_is_the_tp_group() -> None:
    # one process: world size 1, rank 0
    assert get_shard_size(9, 1, AutoTPMeta()) == 9
    with pytest.raises(ValueError, match=r"mp_size \(2\) differs from the world size \(1\)"):
        get_shard_size(9, 2, AutoTPMeta())
