"""Tiny Hugging Face causal LMs built from configs (no downloads) for the AutoTP tests."""

from __future__ import annotations

from typing import Any

import torch

VOCAB = 96


def tiny_config(family: str, *, kv_heads: int = 4, heads: int = 4, hidden: int = 32) -> Any:
    import transformers as tf

    common = {"vocab_size": VOCAB, "max_position_embeddings": 64}
    if family in ("llama", "mistral", "qwen2", "qwen3", "olmo2"):
        cls = {
            "llama": tf.LlamaConfig,
            "mistral": tf.MistralConfig,
            "qwen2": tf.Qwen2Config,
            "qwen3": tf.Qwen3Config,
            "olmo2": tf.Olmo2Config,
        }[family]
        if family == "qwen3":
            common["head_dim"] = hidden // heads  # Qwen3's default head_dim does not follow hidden_size
        return cls(
            hidden_size=hidden,
            intermediate_size=72,
            num_hidden_layers=2,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            tie_word_embeddings=False,
            attention_dropout=0.0,
            **common,
        )
    if family == "opt":
        return tf.OPTConfig(
            hidden_size=32,
            ffn_dim=72,
            num_hidden_layers=2,
            num_attention_heads=heads,
            word_embed_proj_dim=32,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            **common,
        )
    if family == "gpt2":
        return tf.GPT2Config(n_embd=32, n_layer=2, n_head=heads, n_positions=64, vocab_size=VOCAB)
    raise ValueError(family)


def build(family: str, *, seed: int = 0, **kwargs: Any) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **kwargs), attn_implementation="eager")
    return model.float().eval()


def batch(seed: int = 1, *, size: int = 2, seq: int = 12) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (size, seq), generator=gen)
