"""Domino's tensor-parallel transformer (DeepSpeed's `deepspeed.runtime.domino.transformer`).

A Megatron-style pre-LN transformer whose attention heads and MLP hidden units are split over the
tensor-parallel ranks. Each block ends in an all-reduce of a partial sum (the row-parallel projections'),
and each block's backward starts with one (the column-parallel projections' input gradient). Domino
hides them: the batch (`[s, b, h]`, dim 1) is cut into two halves that go through the blocks in turn, and
every all-reduce is asynchronous, so half 0's reduction runs while half 1 computes and the other way round.

Forward order, per block stage (attention, then MLP) and half: wait for this half's pending reduction and
finish the previous stage (bias, dropout, residual), compute this stage up to its partial sum, start its
all-reduce. `DominoTransformer` runs the stages of all layers back to back (inter-layer overlap: half 1's
last reduction of a layer overlaps half 0's next layer); with `config.domino_intra_layer_overlap` each
`DominoTransformerLayer` settles both halves before the next layer. Backward: the column-parallel linears
start their input-gradient all-reduce and return; `_Wait_bwd_comm`, placed right after the layer norm that
feeds them, waits for it only when the layer norm's backward needs it.

`forward_without_overlap` runs the same layers on the whole batch, each reduction waited at once: plain
tensor parallelism, the baseline Domino is measured and tested against.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

import ds_comm
from ds_parallel.domino._attention import (
    AttnMaskType,
    AttnType,
    CoreAttention,
    DominoUtil,
    ShardedAttention,
    config_value,
)
from ds_parallel.domino.async_linear import DominoAsyncColumnParallelLinear, RowParallelLinearNoComm, start_all_reduce

logger = logging.getLogger(__name__)

__all__ = [
    "AttnMaskType",
    "AttnType",
    "CoreAttention",
    "DominoModule",
    "DominoTransformer",
    "DominoTransformerLayer",
    "DominoUtil",
    "LayerType",
    "ModelType",
    "NoOper",
    "ShardedAttention",
    "_Wait_bwd_comm",
    "bias_dropout_add",
]

#: One stage of a block for one half: `(hidden, half id) -> (partial sum, bias, residual)`.
Stage = Callable[[Tensor, Any], tuple[Tensor, Any, Tensor]]


class LayerType(enum.Enum):
    encoder = 1
    decoder = 2


class ModelType(enum.Enum):
    encoder_or_decoder = 1
    encoder_and_decoder = 2


class DominoModule(nn.Module):
    """Base class of Domino's modules."""


class NoOper(torch.autograd.Function):
    """Identity forward; the backward first waits for the pending all-reduce `handle_dic[h_id]`."""

    @staticmethod
    def forward(ctx: Any, input_: Tensor, handle_dic: MutableMapping[Any, Any], h_id: Any) -> Tensor:
        ctx.handle_dic, ctx.h_id = handle_dic, h_id
        return input_.view_as(input_)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor, None, None]:
        handle = ctx.handle_dic.get(ctx.h_id)
        if handle is not None:
            handle.wait()
            ctx.handle_dic[ctx.h_id] = None
        return grad_output, None, None


def _Wait_bwd_comm(input_: Tensor, dic_: MutableMapping[Any, Any], h_id: Any) -> Tensor:  # noqa: N802 - DeepSpeed's
    """Mark `input_` so the backward waits for half `h_id`'s input-gradient all-reduce here."""
    out: Tensor = NoOper.apply(input_, dic_, h_id)  # type: ignore[no-untyped-call]
    return out


class bias_dropout_add(nn.Module):  # noqa: N801 - DeepSpeed's name
    """`residual + dropout(x + bias)`."""

    def __init__(self, prob: float) -> None:
        super().__init__()
        self.dropout = nn.Dropout(prob)

    def forward(self, x: Tensor, bias: Tensor | None, residual: Tensor) -> Tensor:
        if bias is not None:
            x = x + bias
        return self.dropout(x) + residual


def _run_overlapped(
    halves: Sequence[Tensor],
    ids: Sequence[Any],
    stages: Sequence[tuple[Stage, bias_dropout_add]],
    group: Any,
) -> list[Tensor]:
    """Run `stages` over `halves` in turn, each stage's all-reduce in flight while the other half computes."""
    hidden = list(halves)
    pending: list[tuple[Any, Tensor, Any, Tensor, bias_dropout_add] | None] = [None] * len(hidden)

    def settle(i: int) -> None:
        job = pending[i]
        if job is not None:
            handle, partial, bias, residual, finish = job
            if handle is not None:
                handle.wait()
            hidden[i] = finish(partial, bias, residual)
            pending[i] = None

    for stage, finish in stages:
        for i in range(len(hidden)):
            settle(i)
            partial, bias, residual = stage(hidden[i], ids[i])
            pending[i] = (start_all_reduce(partial, group), partial, bias, residual, finish)
    for i in range(len(hidden)):
        settle(i)
    return hidden


class DominoTransformerLayer(DominoModule):
    """One block (`[s, b, h]` halves in, halves out): causal self-attention and a GELU MLP, pre-LN.

    Args:
        config: Megatron-style config: `hidden_size`, `ffn_hidden_size`, `num_attention_heads`,
            `kv_channels`, `layernorm_epsilon`, `hidden_dropout`, `attention_dropout`, `add_bias_linear`,
            `apply_residual_connection_post_layernorm`, `init_method`, `output_layer_init_method`,
            `params_dtype`, `perform_initialization`.
        mpu: gives the tensor-parallel world size and group.
        apply_rotary_pos_emb: applied to q and k when a forward gets `rotary_pos_emb`.
        layer_number: 1-based.

    `forward((hidden0, hidden1), attention_mask, rotary_pos_emb=None)` returns both halves' outputs, each
    half's reductions overlapping the other half's compute inside the layer.
    """

    def __init__(
        self,
        config: Any,
        mpu: Any,
        apply_rotary_pos_emb: Callable[..., Tensor] | None,
        layer_number: int,
        layer_type: LayerType = LayerType.encoder,
        self_attn_mask_type: AttnMaskType = AttnMaskType.causal,
        drop_path_rate: float = 0.0,
    ) -> None:
        super().__init__()
        self.layer_number, self.layer_type = layer_number, layer_type
        self.apply_residual_connection_post_layernorm = bool(
            config_value(config, "apply_residual_connection_post_layernorm", False)
        )
        self.llama_model = False
        hidden, eps = config_value(config, "hidden_size"), config_value(config, "layernorm_epsilon", 1e-5)
        self.input_layernorm = nn.LayerNorm(hidden, eps=eps)
        self.self_attention = ShardedAttention(
            config, mpu, apply_rotary_pos_emb, layer_number, AttnType.self_attn, self_attn_mask_type
        )
        self.hidden_dropout = float(config_value(config, "hidden_dropout", 0.0))
        self.post_attention_layernorm = nn.LayerNorm(hidden, eps=eps)
        if config_value(config, "gated_linear_unit", False):
            logger.warning("Domino: gated_linear_unit is not applied; the MLP is fc1 -> GELU -> fc2 (as DeepSpeed's)")
        tp = int(mpu.get_tensor_model_parallel_world_size())
        ffn = int(config_value(config, "ffn_hidden_size"))
        if ffn % tp:
            raise ValueError(f"Domino: ffn_hidden_size {ffn} must be a multiple of the tensor-parallel size {tp}")
        self.TP_group = mpu.get_tensor_model_parallel_group()
        self.input_size_c = self.output_size_r = hidden
        self.output_size_c = self.input_size_r = ffn
        self.output_size_per_partition = self.input_size_per_partition = ffn // tp
        bias = bool(config_value(config, "add_bias_linear", True))
        self.linear_fc1 = DominoAsyncColumnParallelLinear(
            hidden, ffn // tp, self.TP_group, config=config, init_method=config_value(config, "init_method", None),
            bias=bias,
        )  # fmt: skip
        self.mlp_activation_func = nn.functional.gelu
        self.linear_fc2 = RowParallelLinearNoComm(
            ffn // tp, hidden, config=config, init_method=config_value(config, "output_layer_init_method", None),
            bias=bias, skip_bias_add=True,
        )  # fmt: skip
        self.bias_dropout_add_func = bias_dropout_add(self.hidden_dropout)

    def _residual(self, hidden: Tensor, normed: Tensor) -> Tensor:
        # From the layer norm's output *before* the wait marker: a second consumer after the marker would
        # have autograd sum into the gradient while its all-reduce is still in flight.
        return normed if self.apply_residual_connection_post_layernorm else hidden

    def attention_stage(
        self, hidden: Tensor, h_id: Any, attention_mask: Any = None, rotary_pos_emb: Any = None
    ) -> tuple[Tensor, Any, Tensor]:
        """Layer norm, attention, row-parallel projection: `(partial sum, bias, residual)`."""
        normed = self.input_layernorm(hidden)
        marked = _Wait_bwd_comm(normed, DominoUtil.HANDLE_DIC, h_id)
        partial, bias = self.self_attention(marked, attention_mask, h_id, rotary_pos_emb=rotary_pos_emb)
        return partial, bias, self._residual(hidden, normed)

    def mlp_stage(self, hidden: Tensor, h_id: Any) -> tuple[Tensor, Any, Tensor]:
        """Layer norm, fc1, GELU, fc2: `(partial sum, bias, residual)`."""
        normed = self.post_attention_layernorm(hidden)
        marked = _Wait_bwd_comm(normed, DominoUtil.HANDLE_DIC, h_id)
        out, _ = self.linear_fc1(marked, DominoUtil.HANDLE_DIC, h_id)
        partial, bias = self.linear_fc2(self.mlp_activation_func(out))
        return partial, bias, self._residual(hidden, normed)

    def stages(self, attention_mask: Any, rotary_pos_emb: Any) -> list[tuple[Stage, bias_dropout_add]]:
        """This layer's two stages, each with the function that finishes it after its all-reduce."""

        def attention(hidden: Tensor, h_id: Any) -> tuple[Tensor, Any, Tensor]:
            return self.attention_stage(hidden, h_id, attention_mask, rotary_pos_emb)

        return [(attention, self.bias_dropout_add_func), (self.mlp_stage, self.bias_dropout_add_func)]

    def forward(
        self, hidden_states: Sequence[Tensor], attention_mask: Any, rotary_pos_emb: Any = None
    ) -> tuple[Tensor, ...]:
        ids = (DominoUtil.BATCH_0, DominoUtil.BATCH_1)
        return tuple(_run_overlapped(hidden_states, ids, self.stages(attention_mask, rotary_pos_emb), self.TP_group))


class DominoTransformer(DominoModule):
    """A stack of `config.num_layers` Domino blocks (`[s, b, h] -> [s, b, h]`) with a final layer norm.

    Args follow DeepSpeed's: `config`, `mpu`, `apply_rotary_pos_emb`, `model_type`, `layer_type`,
    `self_attn_mask_type` (causal), `post_layer_norm`, `pre_process`, `post_process`, `drop_path_rate`.
    `config.domino_intra_layer_overlap` picks the per-layer schedule (default: across layers).
    """

    def __init__(
        self,
        config: Any,
        mpu: Any,
        apply_rotary_pos_emb: Callable[..., Tensor] | None,
        model_type: ModelType,
        layer_type: LayerType = LayerType.encoder,
        self_attn_mask_type: AttnMaskType = AttnMaskType.causal,
        post_layer_norm: bool = True,
        pre_process: bool = True,
        post_process: bool = True,
        drop_path_rate: float = 0.0,
    ) -> None:
        super().__init__()
        if not dist.is_initialized():
            ds_comm.init_distributed()
        self.layer_type, self.model_type = layer_type, model_type
        self.post_layer_norm, self.post_process = post_layer_norm, post_process
        self.input_tensor = None
        self.drop_path_rate = drop_path_rate
        self.TP_group = mpu.get_tensor_model_parallel_group()
        self.num_layers = int(config_value(config, "num_layers"))
        self.drop_path_rates = [float(r) for r in torch.linspace(0, drop_path_rate, self.num_layers)]
        self.layers = nn.ModuleList(
            DominoTransformerLayer(
                config, mpu, apply_rotary_pos_emb, i + 1, layer_type, self_attn_mask_type, self.drop_path_rates[i]
            )
            for i in range(self.num_layers)
        )
        if post_process and post_layer_norm:
            self.final_layernorm = nn.LayerNorm(
                config_value(config, "hidden_size"), eps=config_value(config, "layernorm_epsilon", 1e-5)
            )
        self.intra_layer_overlap = bool(config_value(config, "domino_intra_layer_overlap", False))
        logger.info(
            "Domino: %d layers, %s overlap of tensor-parallel all-reduces",
            self.num_layers,
            "intra-layer" if self.intra_layer_overlap else "inter-layer",
        )

    def _layer_list(self) -> list[DominoTransformerLayer]:
        return cast("list[DominoTransformerLayer]", list(self.layers))

    def _final(self, hidden: Tensor) -> Tensor:
        return self.final_layernorm(hidden) if self.post_process and self.post_layer_norm else hidden

    def inter_layer_overlap_forward(
        self, hidden_states: Tensor, attention_mask: Any, rotary_pos_emb: Any = None
    ) -> Tensor:
        halves = torch.chunk(hidden_states, chunks=2, dim=1)
        stages = [stage for layer in self._layer_list() for stage in layer.stages(attention_mask, rotary_pos_emb)]
        out = _run_overlapped(halves, (DominoUtil.BATCH_0, DominoUtil.BATCH_1), stages, self.TP_group)
        return torch.cat([self._final(h) for h in out], dim=1)

    def intra_layer_overlap_forward(
        self, hidden_states: Tensor, attention_mask: Any, rotary_pos_emb: Any = None
    ) -> Tensor:
        halves: Sequence[Tensor] = torch.chunk(hidden_states, chunks=2, dim=1)
        for layer in self.layers:
            halves = layer(halves, attention_mask, rotary_pos_emb)
        return torch.cat([self._final(h) for h in halves], dim=1)

    def forward_without_overlap(self, hidden_states: Tensor, attention_mask: Any, rotary_pos_emb: Any = None) -> Tensor:
        """Plain tensor parallelism on the same weights: the whole batch, every all-reduce waited at once."""
        stages = [stage for layer in self._layer_list() for stage in layer.stages(attention_mask, rotary_pos_emb)]
        (out,) = _run_overlapped([hidden_states], (DominoUtil.BATCH_0,), stages, self.TP_group)
        return self._final(out)

    def forward(self, hidden_states: Tensor, attention_mask: Any, rotary_pos_emb: Any = None) -> Tensor:
        if self.intra_layer_overlap:
            return self.intra_layer_overlap_forward(hidden_states, attention_mask, rotary_pos_emb)
        return self.inter_layer_overlap_forward(hidden_states, attention_mask, rotary_pos_emb)
