"""The tiny Mixtral and token batches the AutoEP dist tests share (built from a config, never downloaded)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["assert_weights_close", "batch", "tiny_mixtral"]


def tiny_mixtral(num_experts: int = 4) -> Any:
    """A 2-layer Mixtral with `num_experts` experts (4), top-2, fp32, seeded."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=num_experts,
        num_experts_per_tok=2,
        max_position_embeddings=32,
    )
    return MixtralForCausalLM(cfg).float()


def batch(rank: int, step: int) -> torch.Tensor:
    """Rank `rank`'s token ids at `step`: 2 sequences of 6 tokens, seeded by both."""
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, 32, (2, 6), generator=g)


def assert_weights_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float) -> None:
    """The same names, and every tensor within `tol` (absolute; 0 means bit-equal)."""
    assert sorted(a) == sorted(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=tol, msg=name)


def train_steps(engine: Any, rank: int, steps: range) -> list[float]:
    """Train `engine` on this rank's batches of `steps` (input ids as labels); the losses."""
    losses = []
    for step in steps:
        ids = batch(rank, step)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses
