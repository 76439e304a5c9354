"""FPDT (fully pipelined distributed transformer, `deepspeed.sequence.fpdt_layer`): a layer's sequence in chunks.

Ulysses alone holds each layer's whole local sequence at once: the QKV projection, the FFN's 4x-wide
intermediate and the `[tokens, vocab]` logits grow with the sequence. FPDT walks the sequence in chunks:
`FPDT_Attention` projects, exchanges and attends one chunk at a time (`FPDTAttentionFunction`), `FPDT_FFN`
and `FPDT_LogitsLoss` recompute their wide intermediates chunk by chunk in backward, and what backward
keeps lives in host memory (`SequenceChunk`) on an accelerator. Chunk i of every rank forms global chunk i,
so the input is laid out by `FPDT_InputConstruct` first (its loss mask in the gathered order).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

import ds_comm
from ds_parallel.sequence._fpdt_attention import FPDTAttentionFunction
from ds_parallel.sequence._fpdt_chunk import SequenceChunk
from ds_parallel.sequence._rotary import _rotate_half_backward, apply_rotary_pos_emb, apply_rotary_pos_emb_backward  # noqa: F401

__all__ = [
    "FPDT_Attention",
    "FPDT_FFN",
    "FPDT_InputConstruct",
    "FPDT_LogitsLoss",
    "SequenceChunk",
    "apply_rotary_pos_emb",
    "apply_rotary_pos_emb_backward",
    "bias_gelu",
    "bias_gelu_back",
    "fpdt_token_order",
    "update_out_and_lse",
]

logger = logging.getLogger(__name__)


def fpdt_token_order(global_seq_len: int, chunk_size: int, sp_size: int, sp_rank: int) -> torch.Tensor:
    """The global positions a rank holds under FPDT: its local chunk i is global chunk `i * sp_size + rank`.

    `chunk_size` is the global chunk (all ranks' local chunks together); `sp_rank=None`-free: one rank's order.
    """
    if global_seq_len % sp_size or global_seq_len % chunk_size or chunk_size % sp_size:
        raise ValueError(
            f"FPDT: the sequence ({global_seq_len}) must divide into chunks of ds_sequence_parallel_fpdt_chunk_size="
            f"{chunk_size} tokens, each split over the {sp_size} sequence ranks"
        )
    local_chunk = chunk_size // sp_size
    chunks = global_seq_len // chunk_size
    starts = (torch.arange(chunks) * sp_size + sp_rank) * local_chunk
    return (starts.unsqueeze(1) + torch.arange(local_chunk)).flatten()


class FPDT_InputConstruct(torch.nn.Module):  # noqa: N801 - DeepSpeed's name
    """Lay out a batch for FPDT: this rank's tokens, labels and position ids; the loss mask of the whole sequence
    in the order `FPDT_LogitsLoss` gathers the per-rank losses.

    `args.ds_sequence_parallel_fpdt_chunk_size` is the global chunk size; tensors are `[batch, seq]`.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor | None,
        loss_mask: torch.Tensor | None,
        attention_mask: Any,
        position_ids: torch.Tensor | None,
        args: Any,
        sp_size: int,
        sp_rank: int,
    ) -> None:
        super().__init__()
        self.tokens, self.labels, self.loss_mask = tokens, labels, loss_mask
        self.attention_mask, self.position_ids = attention_mask, position_ids
        self.global_seq_len, self.batch_size = tokens.shape[1], tokens.shape[0]
        self.fpdt_chunk_size = int(args.ds_sequence_parallel_fpdt_chunk_size)
        self.sp_size, self.sp_rank = sp_size, sp_rank
        self.num_chunk_per_gpu = self.global_seq_len // self.fpdt_chunk_size
        self.local_seq_len = self.global_seq_len // sp_size
        self.chunk_size = self.fpdt_chunk_size // sp_size
        self.device = tokens.device
        fpdt_token_order(self.global_seq_len, self.fpdt_chunk_size, sp_size, sp_rank)  # checks the sizes

    def generate(self) -> tuple[Any, ...]:
        """`(tokens, labels, loss_mask, attention_mask, position_ids)` laid out for this rank."""
        mine = fpdt_token_order(self.global_seq_len, self.fpdt_chunk_size, self.sp_size, self.sp_rank)
        mine = mine.to(self.device)
        gathered = torch.cat(
            [fpdt_token_order(self.global_seq_len, self.fpdt_chunk_size, self.sp_size, r) for r in range(self.sp_size)]
        ).to(self.device)

        def take(t: torch.Tensor | None, idx: torch.Tensor) -> torch.Tensor | None:
            return None if t is None else t[:, idx]

        return (
            take(self.tokens, mine),
            take(self.labels, mine),
            take(self.loss_mask, gathered),
            self.attention_mask,
            take(self.position_ids, mine),
        )


class FPDT_Attention(torch.nn.Module):  # noqa: N801 - DeepSpeed's name
    """Self-attention of a Megatron-style layer over the sequence in chunks (causal).

    Args:
        config: `hidden_size`, `num_attention_heads`, `num_key_value_heads`, `kv_channels` (head size) and
            `attention_dropout` (must be 0 while training).
        first_weight, first_bias: the fused QKV projection `[q | k | v]`.
        second_weight, second_bias: the output projection.
        sequence_process_group: the Ulysses group (None: no sequence parallelism).
        return_bias: return the output projection's bias instead of adding it.
        chunk_size: tokens per global chunk (all ranks' local chunks together).
        enable_offloading: keep what backward needs in host memory.

    forward(`[s_local, b, hidden]`, attention_mask=None, inference_params, rotary_pos_emb=(cos, sin) sequence
    first, cpu_offloading=True) -> `(output [s_local, b, hidden], bias or None)`.
    """

    def __init__(
        self,
        config: Any,
        first_weight: torch.Tensor,
        first_bias: torch.Tensor | None,
        second_weight: torch.Tensor,
        second_bias: torch.Tensor | None,
        sequence_process_group: ProcessGroup | None,
        gather_idx: int = 0,
        scatter_idx: int = 2,
        return_bias: bool = True,
        chunk_size: int = 65536,
        enable_offloading: bool = True,
    ) -> None:
        super().__init__()
        if chunk_size <= 0:
            raise ValueError(f"FPDT_Attention: chunk_size={chunk_size} must be a positive number of tokens")
        self.spg, self.scatter_idx, self.gather_idx, self.config = (
            sequence_process_group,
            scatter_idx,
            gather_idx,
            config,
        )
        self.hidden_size_per_attention_head = config.kv_channels
        self.projection_size = config.kv_channels * config.num_attention_heads
        self.kv_projection_size = config.kv_channels * config.num_key_value_heads
        self.hidden_size = config.hidden_size
        self.qkv_linear_weight, self.qkv_linear_bias = first_weight, first_bias
        self.qkv_dense_weight, self.qkv_dense_bias = second_weight, second_bias
        self.reture_bias = return_bias  # DeepSpeed's attribute name
        self.dropout = float(getattr(config, "attention_dropout", 0.0))
        self.chunk_size = chunk_size
        self.double_buffer = enable_offloading

    def forward(
        self,
        layernorm_output: torch.Tensor,
        attention_mask: Any = None,
        inference_params: Any = None,
        rotary_pos_emb: Any = None,
        cpu_offloading: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        world = ds_comm.get_world_size(self.spg) if self.spg is not None else 1
        global_len = layernorm_output.shape[0] * world
        if global_len % self.chunk_size:
            raise ValueError(
                f"FPDT_Attention: the sequence of {global_len} tokens does not split into chunk_size="
                f"{self.chunk_size} chunks"
            )
        self.num_chunks_attn = global_len // self.chunk_size
        out = FPDTAttentionFunction.apply(
            layernorm_output,
            attention_mask,
            inference_params,
            rotary_pos_emb,
            self.spg,
            self.scatter_idx,
            self.gather_idx,
            self.hidden_size,
            self.projection_size,
            self.hidden_size_per_attention_head,
            self.kv_projection_size,
            self.qkv_linear_weight,
            self.qkv_linear_bias,
            self.dropout if self.training else 0.0,
            self.num_chunks_attn,
            cpu_offloading and self.double_buffer,
        )
        out = out.flatten(2).transpose(0, 1) @ self.qkv_dense_weight.t()
        if not self.reture_bias and self.qkv_dense_bias is not None:
            out = out + self.qkv_dense_bias
        return out, self.qkv_dense_bias if self.reture_bias else None


def bias_gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation."""
    return F.gelu(x, approximate="tanh")


def bias_gelu_back(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The gradient of `bias_gelu` at `x` times `g`."""
    inner = 0.7978845608028654 * (x + 0.044715 * x**3)
    t = torch.tanh(inner)
    d_inner = 0.7978845608028654 * (1 + 3 * 0.044715 * x * x)
    return g * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * d_inner)


def _ffn(x: torch.Tensor, w1: Any, b1: Any, w2: Any, b2: Any, add_bias: bool) -> torch.Tensor:
    return F.linear(bias_gelu(F.linear(x, w1, b1)), w2, b2 if add_bias else None)


class FPDT_FFN(torch.autograd.Function):  # noqa: N801 - DeepSpeed's name
    """`gelu(x @ w1.T + b1) @ w2.T (+ b2)` over `chunk_size` rows (dim 0) at a time; backward recomputes the
    4x-wide intermediate per chunk. Returns `(output, b2 if not add_bias else None)`."""

    @staticmethod
    def forward(ctx: Any, x, w1, b1, w2, b2, add_bias: bool, chunk_size: int):  # type: ignore[no-untyped-def]
        if chunk_size <= 0 or x.shape[0] % chunk_size:
            raise ValueError(f"FPDT_FFN: {x.shape[0]} rows do not split into chunk_size={chunk_size} chunks")
        with torch.no_grad():
            out = torch.cat([_ffn(c, w1, b1, w2, b2, add_bias) for c in x.split(chunk_size)])
        ctx.save_for_backward(x, w1, b1, w2, b2)
        ctx.add_bias, ctx.chunk_size = add_bias, chunk_size
        return out, (None if add_bias else b2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _grad_bias: Any):  # type: ignore[no-untyped-def]
        x, w1, b1, w2, b2 = ctx.saved_tensors
        params = [None if t is None else t.detach().requires_grad_() for t in (w1, b1, w2, b2)]
        live = [p for p in params if p is not None]
        sums = [None if p is None else torch.zeros_like(p) for p in params]
        grad_x = torch.empty_like(x)
        for lo in range(0, x.shape[0], ctx.chunk_size):
            xc = x[lo : lo + ctx.chunk_size].detach().requires_grad_()
            with torch.enable_grad():
                out = _ffn(xc, *params, ctx.add_bias)
                grads = iter(torch.autograd.grad(out, [xc, *live], grad[lo : lo + ctx.chunk_size], allow_unused=True))
            grad_x[lo : lo + ctx.chunk_size] = next(grads)
            for s in sums:
                g = next(grads) if s is not None else None
                if s is not None and g is not None:
                    s += g
        return grad_x, *sums, None, None


def _loss_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


class FPDT_LogitsLoss(torch.autograd.Function):  # noqa: N801 - DeepSpeed's name
    """Per-token cross entropy of `lm_output @ logit_weights.T` in `num_chunk` sequence chunks, gathered over the
    sequence group: `[s_local, b, h]` -> `[s_local * spg_size, b]` (float32 at least). The logits never exist whole:
    backward recomputes them chunk by chunk; every rank back-propagates the same gathered loss."""

    @staticmethod
    def forward(ctx: Any, lm_output, labels, logit_weights, rank: int, spg_size: int, spg: Any, num_chunk: int):  # type: ignore[no-untyped-def]
        s_local = lm_output.shape[0]
        if num_chunk <= 0 or s_local % num_chunk:
            raise ValueError(f"FPDT_LogitsLoss: {s_local} local tokens do not split into num_chunk={num_chunk}")
        labels = labels.t()  # [s_local, b]
        chunk = s_local // num_chunk
        with torch.no_grad():
            parts = []
            for lo in range(0, s_local, chunk):
                logits = (lm_output[lo : lo + chunk] @ logit_weights.t()).to(_loss_dtype(lm_output))
                ce = F.cross_entropy(logits.flatten(0, 1), labels[lo : lo + chunk].flatten(), reduction="none")
                parts.append(ce.view(chunk, -1))
            loss = torch.cat(parts)
        ctx.save_for_backward(lm_output, labels, logit_weights)
        ctx.rank, ctx.chunk, ctx.s_local = rank, chunk, s_local
        if spg_size == 1:
            return loss
        gathered = torch.empty((s_local * spg_size, loss.shape[1]), dtype=loss.dtype, device=loss.device)
        ds_comm.all_gather_into_tensor(gathered, loss.contiguous(), group=spg)
        return gathered

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[no-untyped-def]
        lm_output, labels, weight = ctx.saved_tensors
        grad = grad[ctx.rank * ctx.s_local : (ctx.rank + 1) * ctx.s_local]
        w = weight.detach().requires_grad_()
        grad_w = torch.zeros_like(weight)
        grad_h = torch.empty_like(lm_output)
        for lo in range(0, ctx.s_local, ctx.chunk):
            h = lm_output[lo : lo + ctx.chunk].detach().requires_grad_()
            with torch.enable_grad():
                logits = (h @ w.t()).to(_loss_dtype(h))
                ce = F.cross_entropy(logits.flatten(0, 1), labels[lo : lo + ctx.chunk].flatten(), reduction="none")
                gh, gw = torch.autograd.grad(ce, [h, w], grad[lo : lo + ctx.chunk].flatten().to(ce.dtype))
            grad_h[lo : lo + ctx.chunk] = gh
            grad_w += gw
        return grad_h, None, grad_w, None, None, None, None


def update_out_and_lse(
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
    block_out: torch.Tensor,
    block_lse: torch.Tensor,
    slice_: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge one attention block into a running `(out [b, L, h, d] fp32, lse [b, L, h, 1])`.

    `block_lse` is `[b, h, L]` (the flash-attention layout). The first call (`out is None`) starts the run;
    `slice_` merges into a part of the running tensors.
    """
    if out is None:
        if slice_ is not None:
            raise RuntimeError("update_out_and_lse: the first block cannot take slice_")
        return block_out.to(torch.float32), block_lse.transpose(-2, -1).unsqueeze(-1).contiguous()
    assert lse is not None
    if slice_ is not None:
        new_out, new_lse = _merge(out[slice_], lse[slice_], block_out, block_lse)
        out[slice_], lse[slice_] = new_out, new_lse
        return out, lse
    return _merge(out, lse, block_out, block_lse)


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> tuple:
    block_lse = block_lse.transpose(-2, -1).unsqueeze(-1)
    new_lse = torch.logaddexp(lse, block_lse)
    return torch.exp(lse - new_lse) * out + torch.exp(block_lse - new_lse) * block_out.float(), new_lse


# DeepSpeed's names for the attention function: one implementation, which keeps its chunks in host memory
# when the tensors are on an accelerator and offloading is on, and on the device otherwise.
_FPDTGPUAttentionImpl_ = FPDTAttentionFunction
_FPDTGPUOffloadingAttentionImpl_ = FPDTAttentionFunction
_update_out_and_lse = _merge
