"""`per_head_muon` tagging (`ds_engine._optim.per_head`): which projections split into heads, and when it refuses."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch import nn

from ds_engine._optim.muon import tag_muon_params


class Block(nn.Module):
    def __init__(self, q_rows: int = 12, kv_rows: int = 6, **config: int) -> None:
        super().__init__()
        self.config = SimpleNamespace(**config) if config else None
        self.q_proj = nn.Linear(12, q_rows, bias=False)
        self.k_proj = nn.Linear(12, kv_rows, bias=False)
        self.o_proj = nn.Linear(12, 12, bias=False)
        self.qkv_proj = nn.Linear(12, 36, bias=False)
        self.up_proj = nn.Linear(12, 20)


def test_gqa_heads_from_the_config_and_only_q_k() -> None:
    model = Block(num_attention_heads=4, num_key_value_heads=2, hidden_size=12)  # head_dim = 12 / 4
    tagged = tag_muon_params(model, per_head=True)
    heads = {n: p.muon_num_heads for n, p in model.named_parameters()}
    assert heads == {
        "q_proj.weight": 4,
        "k_proj.weight": 2,
        "o_proj.weight": None,
        "qkv_proj.weight": None,
        "up_proj.weight": None,
        "up_proj.bias": None,
    }
    assert model.q_proj.weight.muon_head_dim == 3 and set(tagged) == {"q_proj.weight", "k_proj.weight"}


def test_tensor_parallel_shard_keeps_the_head_width() -> None:
    model = Block(q_rows=6, kv_rows=3, num_attention_heads=4, num_key_value_heads=2, head_dim=3)  # tp=2 shards
    tag_muon_params(model, per_head=True, tp_size=2)
    assert (model.q_proj.weight.muon_num_heads, model.k_proj.weight.muon_num_heads) == (2, 1)


def test_off_clears_tags_and_nothing_tagged_is_refused() -> None:
    model = Block(num_attention_heads=4, hidden_size=12)
    tag_muon_params(model, per_head=True)
    tag_muon_params(model, per_head=False)
    assert all(p.muon_num_heads is None for p in model.parameters())
    with pytest.raises(ValueError, match="optimizer.params.per_head_muon: no attention projection"):
        tag_muon_params(Block(), per_head=True)  # no model.config
    with pytest.raises(ValueError, match="width mismatch"):
        tag_muon_params(Block(num_attention_heads=5, head_dim=5), per_head=True)
