"""FPDT's attention: the QKV projection, the Ulysses all-to-all and causal attention, one sequence chunk at a time.

Each rank holds `s_local` tokens as `num_chunks` local chunks; local chunk i of every rank together form
global chunk i (FPDT_InputConstruct lays the tokens out so), which the all-to-all gathers for this rank's
heads. Attention of query chunk i runs over key chunks 0..i with the online softmax (running max and
sum of exponentials), the diagonal chunk causally masked, so no `[seq, seq]` score matrix ever exists:
only one `[chunk, chunk]` block. The per-chunk q, k, v, output and log-sum-exp are kept for backward in
host memory when the model runs on an accelerator (`SequenceChunk`); backward recomputes each block's
probabilities from the saved log-sum-exp (the FlashAttention recurrence), then takes the gradients back
through the all-to-all, the rotary embedding and the projection chunk by chunk.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import ProcessGroup

import ds_comm
from ds_parallel.sequence._all_to_all import _exchange
from ds_parallel.sequence._fpdt_chunk import SequenceChunk
from ds_parallel.sequence._rotary import apply_rotary_pos_emb, apply_rotary_pos_emb_backward

__all__ = ["FPDTAttentionFunction"]


def _to_heads(t: torch.Tensor, group: ProcessGroup | None, world: int) -> torch.Tensor:
    """`[b, L, h, d]` local chunk -> `[b, h/world, L*world, d]` global chunk of this rank's heads."""
    if world > 1:
        t = _exchange(t.contiguous(), group, 2, 1, [t.shape[2] // world] * world, [t.shape[1]] * world)
    return t.transpose(1, 2).contiguous()


def _to_sequence(t: torch.Tensor, group: ProcessGroup | None, world: int) -> torch.Tensor:
    """The inverse of `_to_heads`: `[b, h/world, L*world, d]` -> `[b, L, h, d]`."""
    t = t.transpose(1, 2).contiguous()
    if world > 1:
        t = _exchange(t, group, 1, 2, [t.shape[1] // world] * world, [t.shape[2]] * world)
    return t


def _rope_slices(rotary: Any, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """cos/sin (`[S, *, 1, rot]`, sequence first) of positions `[start, end)` as `[*, 1, L, rot]`."""
    if rotary is None:
        return None
    cos, sin = rotary
    return cos[start:end].permute(1, 2, 0, 3), sin[start:end].permute(1, 2, 0, 3)


def _expand_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _reduce_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t if groups == 1 else t.unflatten(1, (-1, groups)).sum(dim=2)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, diagonal: bool) -> torch.Tensor:
    s = (q @ k.transpose(-1, -2)) * scale
    if diagonal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


class FPDTAttentionFunction(torch.autograd.Function):
    """`[s_local, b, hidden]` normed input -> `[b, s_local, heads, head_dim]` attention output, chunked."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        attention_mask: Any,
        inference_params: Any,
        rotary_pos_emb: Any,
        group: ProcessGroup | None,
        scatter_idx: int,
        gather_idx: int,
        hidden_size: int,
        projection_size: int,
        head_dim: int,
        kv_projection_size: int,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        dropout: float,
        num_chunks: int = 8,
        cpu_offloading: bool = True,
    ) -> torch.Tensor:
        if attention_mask is not None:
            raise ValueError("FPDT attention is causal over the whole sequence: attention_mask must be None")
        if dropout and torch.is_grad_enabled():
            raise ValueError(f"FPDT attention has no attention dropout: got dropout={dropout}; set it to 0")
        world = ds_comm.get_world_size(group) if group is not None else 1
        s_local = x.shape[0]
        if num_chunks < 1 or s_local % num_chunks:
            raise ValueError(f"FPDT: {s_local} local tokens do not split into num_chunks={num_chunks} equal chunks")
        heads, kv_heads = projection_size // head_dim, kv_projection_size // head_dim
        if heads % world or kv_heads % world:
            raise ValueError(
                f"FPDT: {heads} query and {kv_heads} key/value heads must both divide by the {world} sequence ranks"
            )
        chunk = s_local // num_chunks
        scale = head_dim**-0.5
        stat = torch.promote_types(x.dtype, torch.float32)
        qs: list[SequenceChunk] = []
        ks: list[SequenceChunk] = []
        vs: list[SequenceChunk] = []
        outs: list[SequenceChunk] = []
        lses: list[SequenceChunk] = []
        xs: list[SequenceChunk] = []
        result = []
        with torch.no_grad():
            for i in range(num_chunks):
                xi = x[i * chunk : (i + 1) * chunk]
                qkv = torch.nn.functional.linear(xi, weight, bias).transpose(0, 1)  # [b, L, proj + 2 kv]
                parts = qkv.split([projection_size, kv_projection_size, kv_projection_size], dim=-1)
                q, k, v = (_to_heads(p.unflatten(-1, (-1, head_dim)), group, world) for p in parts)
                rope = _rope_slices(rotary_pos_emb, i * chunk * world, (i + 1) * chunk * world)
                if rope is not None:
                    q, k = apply_rotary_pos_emb(q, *rope), apply_rotary_pos_emb(k, *rope)
                ks.append(SequenceChunk(k, offload=cpu_offloading))
                vs.append(SequenceChunk(v, offload=cpu_offloading))
                groups = q.shape[1] // k.shape[1]
                row_max = torch.full(q.shape[:-1], float("-inf"), dtype=stat, device=q.device)
                row_sum = torch.zeros_like(row_max)
                acc = torch.zeros(q.shape, dtype=stat, device=q.device)
                for j in range(i + 1):
                    kj, vj = (_expand_kv(c.get(), groups) for c in (ks[j], vs[j]))
                    s = _scores(q, kj, scale, j == i).to(stat)
                    new_max = torch.maximum(row_max, s.amax(dim=-1))
                    decay = torch.exp(row_max - new_max)
                    p = torch.exp(s - new_max.unsqueeze(-1))
                    row_sum = row_sum * decay + p.sum(dim=-1)
                    acc = acc * decay.unsqueeze(-1) + p @ vj.to(stat)
                    row_max = new_max
                out = (acc / row_sum.unsqueeze(-1)).to(x.dtype)
                lse = row_max + row_sum.log()
                qs.append(SequenceChunk(q, offload=cpu_offloading))
                outs.append(SequenceChunk(out, offload=cpu_offloading))
                lses.append(SequenceChunk(lse, offload=cpu_offloading))
                xs.append(SequenceChunk(xi, offload=cpu_offloading))
                result.append(_to_sequence(out, group, world))
        ctx.chunks = (xs, qs, ks, vs, outs, lses)
        ctx.save_for_backward(weight, bias)
        ctx.meta = (group, world, chunk, num_chunks, scale, head_dim, projection_size, kv_projection_size)
        ctx.rotary = rotary_pos_emb
        return torch.cat(result, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        weight, bias = ctx.saved_tensors
        xs, qs, ks, vs, outs, lses = ctx.chunks
        group, world, chunk, n, scale, head_dim, proj, kv_proj = ctx.meta
        stat = torch.promote_types(grad.dtype, torch.float32)
        d_out = [_to_heads(grad[:, i * chunk : (i + 1) * chunk].to(stat), group, world) for i in range(n)]
        delta = [(d_out[i] * outs[i].get().to(stat)).sum(dim=-1) for i in range(n)]
        dq = [torch.zeros(qs[i].shape, dtype=stat, device=grad.device) for i in range(n)]
        grad_x = torch.empty((n * chunk, *xs[0].shape[1:]), dtype=xs[0].chunk_dtype, device=grad.device)
        grad_w = torch.zeros(weight.shape, dtype=stat, device=weight.device)
        grad_b = None if bias is None else torch.zeros(bias.shape, dtype=stat, device=bias.device)
        for j in range(n):  # key chunk j: its dk, dv are complete after the query chunks i >= j
            kj, vj = ks[j].get().to(stat), vs[j].get().to(stat)
            groups = qs[0].shape[1] // kj.shape[1]
            ke, ve = _expand_kv(kj, groups), _expand_kv(vj, groups)
            dk, dv = torch.zeros_like(ke), torch.zeros_like(ve)
            for i in range(j, n):
                qi = qs[i].get().to(stat)
                p = torch.exp(_scores(qi, ke, scale, i == j) - lses[i].get().unsqueeze(-1))
                dv += p.transpose(-1, -2) @ d_out[i]
                ds = p * (d_out[i] @ ve.transpose(-1, -2) - delta[i].unsqueeze(-1))
                dq[i] += (ds @ ke) * scale
                dk += (ds.transpose(-1, -2) @ qi) * scale
            dk, dv = _reduce_kv(dk, groups), _reduce_kv(dv, groups)
            # query chunk j is complete too: every key chunk <= j has been visited
            dqj = dq[j]
            rope = _rope_slices(ctx.rotary, j * chunk * world, (j + 1) * chunk * world)
            if rope is not None:
                dqj = apply_rotary_pos_emb_backward(dqj, *rope)
                dk = apply_rotary_pos_emb_backward(dk, *rope)
            dq[j] = torch.empty(0)
            d_qkv = torch.cat([_to_sequence(t, group, world).flatten(2) for t in (dqj, dk, dv)], dim=-1)
            d_qkv = d_qkv.transpose(0, 1)  # [L, b, proj + 2 kv]
            xj = xs[j].get().to(stat)
            grad_x[j * chunk : (j + 1) * chunk] = (d_qkv @ weight.to(stat)).to(grad_x.dtype)
            grad_w += d_qkv.flatten(0, 1).t() @ xj.flatten(0, 1)
            if grad_b is not None:
                grad_b += d_qkv.sum(dim=(0, 1))
        ctx.chunks = None
        return (
            grad_x,
            *([None] * 10),
            grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
            None,
            None,
            None,
        )
