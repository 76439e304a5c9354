"""AutoTP's single-process rules: shard sizes, shard/unshard round trips, and which layers are row-parallel.

The expected splits and row-parallel names are DeepSpeed 0.19.8's (`get_shard_size_list`, `AutoTP.tp_parser`
on the same tiny models give the same answers).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ds_parallel.tensor import ShardLayout, TPMeta, find_block_policies, shard_sizes


def test_attention_splits_by_kv_heads_and_mlp_near_evenly() -> None:
    meta = TPMeta(num_kv_heads=2, num_attention_heads=8, hidden_size=64)
    assert shard_sizes(64, 2, meta, "self_attn.q_proj") == (32, 32)
    assert shard_sizes(16, 2, meta, "self_attn.k_proj") == (8, 8)
    # 3 kv heads over 2 ranks: whole heads, the first rank takes the extra one (DeepSpeed's split)
    assert shard_sizes(48, 2, TPMeta(num_kv_heads=3), "self_attn.q_proj") == (32, 16)
    assert shard_sizes(75, 2, meta, "mlp.up_proj") == (38, 37)
    assert shard_sizes(100, 3, TPMeta(tp_grain_size=8), "lm_head") == (32, 32, 36)


def test_sectioned_layout_round_trip() -> None:
    layout = ShardLayout(0, ((4, 4), (2, 2), (2, 2)))  # q | k | v over two ranks
    full = torch.arange(16.0).reshape(16, 1)
    shards = [layout.shard(full, r) for r in range(2)]
    assert shards[0].flatten().tolist() == [0, 1, 2, 3, 8, 9, 12, 13]
    assert torch.equal(layout.unshard(shards), full)
    with pytest.raises(ValueError, match="dim 0 should be 16"):
        layout.shard(torch.zeros(15, 1), 0)


def test_llama_and_opt_row_parallel_layers() -> None:
    pytest.importorskip("transformers")
    from tiny_hf import build

    llama = find_block_policies(build("llama"))
    assert [p.block_type.__name__ for p in llama] == ["LlamaDecoderLayer"]
    assert llama[0].row_parallel == {"self_attn.o_proj", "mlp.down_proj"}
    opt = find_block_policies(build("opt"))
    assert opt[0].row_parallel == {"self_attn.out_proj", ".fc2"}


def test_a_model_without_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="AutoTP cannot shard Sequential: no block .* blocks found: none"):
        find_block_policies(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)))
