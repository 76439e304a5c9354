"""`deepspeed.ops.random_ltd.dropping_utils`: ds's `_data.token_ops` (no compiled op: plain PyTorch)."""

from __future__ import annotations

from ds_engine._data.token_ops import GatherTokens, ScatterTokens, bert_sample_tokens, gpt_sample_tokens

__all__ = ["GatherTokens", "ScatterTokens", "bert_sample_tokens", "gpt_sample_tokens"]
