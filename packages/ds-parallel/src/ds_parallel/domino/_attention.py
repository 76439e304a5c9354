"""Domino's tensor-parallel causal self-attention: heads split over the tensor-parallel ranks.

Activations are `[s, b, h]` (sequence first, Megatron's layout). The fused QKV projection is
column-parallel, laid out per head as `[q | k | v]` of `kv_channels` each, so rank r's rows are the QKV of
heads `r * heads/tp .. (r + 1) * heads/tp`; the output projection is row-parallel and returns a partial sum
that the caller reduces.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, MutableMapping
from typing import Any

import torch
from torch import Tensor, nn

from ds_parallel.domino.async_linear import DominoAsyncColumnParallelLinear, RowParallelLinearNoComm

logger = logging.getLogger(__name__)

__all__ = ["AttnMaskType", "AttnType", "CoreAttention", "DominoUtil", "ShardedAttention", "config_value"]


class DominoUtil:
    """The two half-batches' names and the process-wide table of their pending backward all-reduces."""

    BATCH_0 = "BATCH0"
    BATCH_1 = "BATCH1"
    HANDLE_DIC: dict[str, Any] = {"BATCH0": None, "BATCH1": None}


class AttnType(enum.Enum):
    self_attn = 1
    cross_attn = 2


class AttnMaskType(enum.Enum):
    padding = 1
    causal = 2


def config_value(config: Any, name: str, default: Any = ...) -> Any:
    """`config.name`, or `default`; a missing required field is a ValueError naming it."""
    value = getattr(config, name, default)
    if value is ...:
        raise ValueError(f"Domino: the model config has no {name!r} (a Megatron-style TransformerConfig field)")
    return value


def _projection_size(config: Any) -> int:
    heads = config_value(config, "num_attention_heads")
    kv_channels = config_value(config, "kv_channels", None) or config_value(config, "hidden_size") // heads
    return int(kv_channels * heads)


class CoreAttention(nn.Module):
    """Causal scaled-dot-product attention over this rank's heads: `[b, n, s, d]` q/k/v -> `[s, b, n * d]`.

    The mask argument is not read: the mask is causal (`attn_mask_type` must be causal). Attention dropout
    (`config.attention_dropout`) applies in training only.
    """

    def __init__(self, config: Any, tp_world_size: int, attn_mask_type: AttnMaskType = AttnMaskType.causal) -> None:
        super().__init__()
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"Domino attention supports the causal mask only, got attn_mask_type={attn_mask_type}")
        projection = _projection_size(config)
        if projection % tp_world_size:
            raise ValueError(
                f"Domino: the attention projection size {projection} (kv_channels x num_attention_heads) must be "
                f"a multiple of the tensor-parallel world size {tp_world_size}"
            )
        self.attn_mask_type = attn_mask_type
        self.hidden_size_per_partition = projection // tp_world_size
        self.attention_dropout_rate = float(config_value(config, "attention_dropout", 0.0))

    def forward(self, query_layer: Tensor, key_layer: Tensor, value_layer: Tensor, attention_mask: Any) -> Tensor:
        context = nn.functional.scaled_dot_product_attention(
            query_layer,
            key_layer,
            value_layer,
            dropout_p=self.attention_dropout_rate if self.training else 0.0,
            is_causal=True,
        )
        context = context.permute(2, 0, 1, 3).contiguous()  # [b, n, s, d] -> [s, b, n, d]
        return context.view(*context.shape[:-2], self.hidden_size_per_partition)


class ShardedAttention(nn.Module):
    """Self-attention with this rank's heads (see the module docstring); self-attention, causal mask only.

    Args:
        config: Megatron-style config (`hidden_size`, `num_attention_heads`, `kv_channels`, `init_method`,
            `output_layer_init_method`, `add_bias_linear`, `attention_dropout`, `params_dtype`).
        mpu: gives `get_tensor_model_parallel_world_size()` and `get_tensor_model_parallel_group()`.
        apply_rotary_pos_emb: `fn(t [b, n, s, d], freqs) -> t`, used when a forward gets `rotary_pos_emb`.
        layer_number: 1-based.

    `forward(hidden_states, attention_mask, micro_batch_num, rotary_pos_emb=None)` returns the row-parallel
    projection's `(partial output, bias)`; `micro_batch_num` keys the backward all-reduce handle.
    """

    def __init__(
        self,
        config: Any,
        mpu: Any,
        apply_rotary_pos_emb: Callable[..., Tensor] | None,
        layer_number: int,
        attention_type: AttnType = AttnType.self_attn,
        attn_mask_type: AttnMaskType = AttnMaskType.causal,
    ) -> None:
        super().__init__()
        if attention_type != AttnType.self_attn:
            raise ValueError(f"Domino attention supports self-attention only, got attention_type={attention_type}")
        self.layer_number = max(1, layer_number)
        self.attention_type, self.attn_mask_type = attention_type, attn_mask_type
        self.apply_rotary_pos_emb = apply_rotary_pos_emb
        tp = int(mpu.get_tensor_model_parallel_world_size())
        heads = int(config_value(config, "num_attention_heads"))
        if heads % tp:
            raise ValueError(f"Domino: num_attention_heads {heads} must be a multiple of the tensor-parallel size {tp}")
        projection = _projection_size(config)
        self.hidden_size_per_attention_head = projection // heads
        self.num_attention_heads_per_partition = heads // tp
        bias = bool(config_value(config, "add_bias_linear", True))
        self.query_key_value = DominoAsyncColumnParallelLinear(
            config_value(config, "hidden_size"),
            3 * projection // tp,
            mpu.get_tensor_model_parallel_group(),
            config=config,
            init_method=config_value(config, "init_method", None),
            bias=bias,
        )
        self.core_attention = CoreAttention(config, tp, attn_mask_type)
        self.dense = RowParallelLinearNoComm(
            projection // tp,
            config_value(config, "hidden_size"),
            config=config,
            init_method=config_value(config, "output_layer_init_method", None),
            bias=bias,
            skip_bias_add=True,
        )

    def domino_core_attention_forward(
        self, mixed_x_layer: Tensor, attention_mask: Any, rotary_pos_emb: Any = None
    ) -> Tensor:
        """From the QKV projection `[s, b, 3 * n * d]` to the attention context `[s, b, n * d]`."""
        d = self.hidden_size_per_attention_head
        mixed = mixed_x_layer.view(*mixed_x_layer.shape[:-1], self.num_attention_heads_per_partition, 3 * d)
        query, key, value = torch.split(mixed.permute(1, 2, 0, 3), [d, d, d], dim=3)  # each [b, n, s, d]
        if rotary_pos_emb is not None and self.apply_rotary_pos_emb is not None:
            q_emb, k_emb = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
            query, key = self.apply_rotary_pos_emb(query, q_emb), self.apply_rotary_pos_emb(key, k_emb)
        return self.core_attention(query, key, value, attention_mask)

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Any,
        micro_batch_num: Any,
        rotary_pos_emb: Any = None,
        handle_dic: MutableMapping[Any, Any] | None = None,
    ) -> tuple[Tensor, Any]:
        handles = DominoUtil.HANDLE_DIC if handle_dic is None else handle_dic
        mixed, _ = self.query_key_value(hidden_states, handles, micro_batch_num)
        context = self.domino_core_attention_forward(mixed, attention_mask, rotary_pos_emb)
        output: tuple[Tensor, Any] = self.dense(context)
        return output
