"""`deepspeed.ops.random_ltd`: random-LTD's token sampling, gather and scatter (plain PyTorch, any device)."""

from __future__ import annotations

from ds_engine.ops.random_ltd.dropping_utils import GatherTokens, ScatterTokens, bert_sample_tokens, gpt_sample_tokens

__all__ = ["GatherTokens", "ScatterTokens", "bert_sample_tokens", "gpt_sample_tokens"]
