"""Domino at tensor-parallel degree 2 on gloo against plain tensor parallelism and a one-rank model.

A 2-layer DominoTransformer is built from the weights of a plain PyTorch transformer written out here
(pre-LN, causal attention with per-head `[q|k|v]` rows, GELU MLP), its attention heads and MLP units split
over the two ranks. Its output loss, input gradient and every parameter's gradient (against the matching
slice of the one-rank model's) must agree to 1e-5 for the inter-layer schedule, the intra-layer schedule
and plain tensor parallelism (`forward_without_overlap`, the same layers on the whole batch).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from ds_comm.testing import run_ranks

HIDDEN, HEADS, FFN, LAYERS, SEQ, BATCH = 16, 4, 32, 2, 6, 4


def _config(intra: bool) -> SimpleNamespace:
    return SimpleNamespace(
        hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS, kv_channels=HIDDEN // HEADS,
        num_layers=LAYERS, layernorm_epsilon=1e-5, hidden_dropout=0.0, attention_dropout=0.0,
        add_bias_linear=True, apply_residual_connection_post_layernorm=False, gated_linear_unit=False,
        init_method=nn.init.zeros_, output_layer_init_method=nn.init.zeros_, params_dtype=torch.float32,
        perform_initialization=True, domino_intra_layer_overlap=intra,
    )  # fmt: skip


def _full_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w: dict[str, torch.Tensor] = {}
    for i in range(LAYERS):
        p = f"layers.{i}."
        for name, shape in [
            ("input_layernorm.weight", (HIDDEN,)), ("input_layernorm.bias", (HIDDEN,)),
            ("self_attention.query_key_value.weight", (3 * HIDDEN, HIDDEN)),
            ("self_attention.query_key_value.bias", (3 * HIDDEN,)),
            ("self_attention.dense.weight", (HIDDEN, HIDDEN)), ("self_attention.dense.bias", (HIDDEN,)),
            ("post_attention_layernorm.weight", (HIDDEN,)), ("post_attention_layernorm.bias", (HIDDEN,)),
            ("linear_fc1.weight", (FFN, HIDDEN)), ("linear_fc1.bias", (FFN,)),
            ("linear_fc2.weight", (HIDDEN, FFN)), ("linear_fc2.bias", (HIDDEN,)),
        ]:  # fmt: skip
            w[p + name] = torch.randn(*shape, generator=g) * 0.3 + (1.0 if name.endswith("norm.weight") else 0.0)
    w["final_layernorm.weight"] = torch.ones(HIDDEN) + 0.1 * torch.randn(HIDDEN, generator=g)
    w["final_layernorm.bias"] = 0.1 * torch.randn(HIDDEN, generator=g)
    return w


def _reference(w: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The one-rank model: plain PyTorch on the full weights, `[s, b, h]`."""
    d = HIDDEN // HEADS
    h = x
    for i in range(LAYERS):
        p = f"layers.{i}."
        n = nn.functional.layer_norm(h, (HIDDEN,), w[p + "input_layernorm.weight"], w[p + "input_layernorm.bias"])
        qkv = nn.functional.linear(
            n, w[p + "self_attention.query_key_value.weight"], w[p + "self_attention.query_key_value.bias"]
        )
        q, k, v = qkv.view(SEQ, -1, HEADS, 3 * d).permute(1, 2, 0, 3).split(d, dim=3)
        ctx = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3)
        ctx = ctx.reshape(SEQ, -1, HIDDEN)
        h = h + nn.functional.linear(ctx, w[p + "self_attention.dense.weight"], w[p + "self_attention.dense.bias"])
        n = nn.functional.layer_norm(
            h, (HIDDEN,), w[p + "post_attention_layernorm.weight"], w[p + "post_attention_layernorm.bias"]
        )
        mid = nn.functional.gelu(nn.functional.linear(n, w[p + "linear_fc1.weight"], w[p + "linear_fc1.bias"]))
        h = h + nn.functional.linear(mid, w[p + "linear_fc2.weight"], w[p + "linear_fc2.bias"])
    return nn.functional.layer_norm(h, (HIDDEN,), w["final_layernorm.weight"], w["final_layernorm.bias"])


def _shard(name: str, full: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank `rank`'s slice (tp 2): column-parallel rows (QKV per head, fc1), row-parallel columns."""
    if name.endswith(("query_key_value.weight", "query_key_value.bias", "linear_fc1.weight", "linear_fc1.bias")):
        return full.chunk(2, dim=0)[rank]
    if name.endswith(("dense.weight", "linear_fc2.weight")):
        return full.chunk(2, dim=1)[rank]
    return full


class _Mpu:
    def __init__(self) -> None:
        import torch.distributed as dist

        self.group = dist.group.WORLD

    def get_tensor_model_parallel_world_size(self) -> int:
        return 2

    def get_tensor_model_parallel_group(self) -> Any:
        return self.group


def _run(rank: int, world: int) -> dict[str, dict[str, float]]:
    from ds_parallel.domino.transformer import DominoTransformer, ModelType

    full = {n: t.requires_grad_() for n, t in _full_weights().items()}
    g = torch.Generator().manual_seed(1)
    x, target = torch.randn(SEQ, BATCH, HIDDEN, generator=g), torch.randn(SEQ, BATCH, HIDDEN, generator=g)
    x_ref = x.clone().requires_grad_()
    ref_loss = nn.functional.mse_loss(_reference(full, x_ref), target)
    ref_loss.backward()

    results = {}
    for mode in ("inter", "intra", "plain"):
        model = DominoTransformer(_config(mode == "intra"), _Mpu(), None, ModelType.encoder_or_decoder)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(_shard(name, full[name].detach(), rank))
        x_in = x.clone().requires_grad_()
        out = model.forward_without_overlap(x_in, None) if mode == "plain" else model(x_in, None)
        loss = nn.functional.mse_loss(out, target)
        loss.backward()
        grad = max(
            float((p.grad - _shard(name, full[name].grad, rank)).abs().max()) for name, p in model.named_parameters()
        )
        results[mode] = {
            "loss": abs(float(loss) - float(ref_loss)),
            "input_grad": float((x_in.grad - x_ref.grad).abs().max()),
            "grad": grad,
            "grad_scale": float(max(t.grad.abs().max() for t in full.values())),
        }
    return results


@pytest.mark.timeout(120)
def test_domino_matches_plain_tensor_parallelism_and_one_rank() -> None:
    for result in run_ranks(2, _run, timeout_s=100):
        for mode, errors in result.items():
            assert errors["loss"] <= 1e-5 and errors["input_grad"] <= 1e-5, (mode, errors)
            assert errors["grad"] <= 1e-5 and errors["grad_scale"] > 1e-2, (mode, errors)
