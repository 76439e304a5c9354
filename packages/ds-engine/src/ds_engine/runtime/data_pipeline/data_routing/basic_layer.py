"""`deepspeed.runtime.data_pipeline.data_routing.basic_layer`: `RandomLayerTokenDrop`, the random-LTD layer wrapper."""

from __future__ import annotations

from ds_engine._data.token_drop import RandomLayerTokenDrop
from ds_engine._data.token_ops import GatherTokens, ScatterTokens, bert_sample_tokens, gpt_sample_tokens

__all__ = ["GatherTokens", "RandomLayerTokenDrop", "ScatterTokens", "bert_sample_tokens", "gpt_sample_tokens"]
