"""DeepSpeed's `tp_shard` spellings (`AutoTPMeta`, `get_shard_size[_list]`) give the shares ds's layers cut by."""

from __future__ import annotations

import pytest

from ds_parallel.tensor import AutoTPMeta, TPMeta, get_shard_size, get_shard_size_list, shard_sizes


class _Config:
    num_attention_heads = 8
    num_key_value_heads = 2
    hidden_size = 64


def test_meta_reads_a_config_under_deepspeeds_field_names() -> None:
    meta = AutoTPMeta.from_model_config(_Config(), tp_grain_size=4)
    assert meta == AutoTPMeta(num_kv_heads=2, num_attention_heads=8, n_embd=64, tp_grain_size=4)
    assert meta.to_tp_meta() == TPMeta.from_model_config(_Config(), 4)
    assert AutoTPMeta.from_tp_meta(meta.to_tp_meta()) == meta
    assert AutoTPMeta.from_model_config(None) == AutoTPMeta()


@pytest.mark.parametrize(
    ("total", "tp", "meta", "name", "expected"),
    [
        (101, 2, AutoTPMeta(), "lm_head", [51, 50]),
        (10, 3, AutoTPMeta(), "lm_head", [4, 3, 3]),
        (384, 4, AutoTPMeta(num_kv_heads=6), "self_attn.q_proj", [128, 128, 64, 64]),  # whole heads per rank
        (384, 4, AutoTPMeta(num_kv_heads=6), "lm_head", [96, 96, 96, 96]),  # the output head splits evenly
        (10, 3, AutoTPMeta(tp_grain_size=4), "mlp.up_proj", [4, 4, 2]),  # grain units, tail on the last rank
    ],
)
def test_shares_tile_the_dimension_as_the_layers_cut_it(
    total: int, tp: int, meta: AutoTPMeta, name: str, expected: list[int]
) -> None:
    sizes = get_shard_size_list(total, tp, meta, name)
    assert sizes == expected and sum(sizes) == total
    assert sizes == list(shard_sizes(total, tp, meta.to_tp_meta(), name))
    assert [get_shard_size(total, tp, meta, name, rank=r) for r in range(tp)] == expected


def test_the_older_call_form_without_a_meta_splits_near_evenly() -> None:
    assert get_shard_size_list(101, 2, "lm_head") == [51, 50]
    assert get_shard_size_list(7, 3) == [3, 2, 2]


def test_bad_meta_and_an_unknown_rank_are_refused() -> None:
    with pytest.raises(TypeError, match="AutoTPMeta"):
        get_shard_size_list(8, 2, 3)
    with pytest.raises(TypeError, match="name 'x' is given too"):
        get_shard_size_list(8, 2, "lm_head", "x")
    with pytest.raises(ValueError, match="differs from the world size"):
        get_shard_size(8, 2, AutoTPMeta(), "x")  # no process group: a world of 1, not the 2 asked for
