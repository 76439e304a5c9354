"""Tiny Hugging Face causal LMs built from configs (no downloads) for the inference, AutoTP and hybrid engine
tests, and DeepSpeed-Chat's LoRA linear for the hybrid engine's LoRA fusion."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

VOCAB = 96
#: Llama-like decoders built from the same sizes (Olmo2's plan has a style AutoTP refuses).
_DECODER_CONFIGS = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "olmo2": "Olmo2Config"}


def tiny_config(family: str, *, kv_heads: int = 4, heads: int = 4, hidden: int = 32) -> Any:
    import transformers as tf

    common = {"vocab_size": VOCAB, "max_position_embeddings": 64}
    if family in _DECODER_CONFIGS:
        return getattr(tf, _DECODER_CONFIGS[family])(
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


def greedy(gen: Any, ids: torch.Tensor, new_tokens: int) -> Any:
    """`new_tokens` greedy tokens from `gen` (a `generate`), with their scores (no early stop at eos)."""
    return gen(
        ids,
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
    )


def batch(seed: int = 1, *, size: int = 2, seq: int = 12) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (size, seq), generator=gen)


class LoraLinear(nn.Module):
    """DeepSpeed-Chat's LoRA linear: frozen `weight` [out, in], factors right [in, r] and left [r, out]."""

    def __init__(self, base: nn.Linear, rank: int = 4, scaling: float = 2.0) -> None:
        super().__init__()
        self.weight = base.weight
        self.bias = base.bias
        self.lora_right_weight = nn.Parameter(torch.randn(base.in_features, rank) * 0.3)
        self.lora_left_weight = nn.Parameter(torch.randn(rank, base.out_features) * 0.3)
        self.lora_scaling = scaling / rank
        self.fuse_lora = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = nn.functional.linear(x, self.weight, self.bias)
        if self.fuse_lora:
            return out
        return out + (x @ self.lora_right_weight @ self.lora_left_weight) * self.lora_scaling


def lora_llama(seed: int = 0) -> nn.Module:
    """The tiny Llama with LoRA on every attention projection (q, k, v, o)."""
    model = build("llama", seed=seed)
    torch.manual_seed(seed + 1)
    for layer in model.model.layers:
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(attn, name, LoraLinear(getattr(attn, name)))
    return model


def merged_copy(model: nn.Module) -> nn.Module:
    """A copy whose LoRA layers are plain linears on `weight + scaling * left.T @ right.T`."""
    merged = copy.deepcopy(model)
    for name, module in list(merged.named_modules()):
        if isinstance(module, LoraLinear):
            parent_name, _, child = name.rpartition(".")
            w = module.weight + module.lora_scaling * (module.lora_left_weight.t() @ module.lora_right_weight.t())
            linear = nn.Linear(w.shape[1], w.shape[0], bias=module.bias is not None)
            with torch.no_grad():
                linear.weight.copy_(w)
            setattr(merged.get_submodule(parent_name), child, linear)
    return merged
