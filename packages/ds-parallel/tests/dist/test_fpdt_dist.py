"""FPDT at SP=2 on 2 gloo ranks equals plain attention on the whole sequence and Ulysses at SP=2 (float64, 1e-5).

The block: fused QKV projection, rotary, causal GQA attention in 4 chunks, output projection; then
FPDT's chunked logits loss. Outputs are compared token by token (FPDT holds chunks 0, 2 / 1, 3 of the
sequence per rank; Ulysses contiguous halves), gradients of the input per token and of the weights summed
over the ranks.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ds_comm.testing import run_ranks

TOL = {"atol": 1e-5, "rtol": 1e-5}
SEQ, BATCH, VOCAB, CHUNK = 16, 2, 19, 4


def _gather(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim=dim)


def _summed(t: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    t = t.clone()
    dist.all_reduce(t)
    return t


def _case(rank: int, world: int) -> dict[str, float]:
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from fpdt_reference import HEAD_DIM, HEADS, HIDDEN, KV_HEADS, attention_block, config, params, rotary

    from ds_parallel import DistributedAttention
    from ds_parallel.sequence import FPDT_Attention, FPDT_LogitsLoss
    from ds_parallel.sequence._fpdt import fpdt_token_order

    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=gen, dtype=torch.float64)
    head = torch.randn(VOCAB, HIDDEN, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    p, rope = params(), rotary(SEQ)
    errs: dict[str, Any] = {}

    def close(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"rank {rank} {name}: {m}")
        errs[name] = float((got - want).detach().abs().max())

    # The reference: the whole sequence on one rank; loss = mean per-token CE of the block's output.
    ref_x, ref_w = x.clone().requires_grad_(), {k: v.clone().requires_grad_() for k, v in p.items()}
    ref_out = attention_block(ref_x, ref_w, rope)
    ref_loss = F.cross_entropy((ref_out @ head.t()).flatten(0, 1), labels.t().flatten())
    ref_loss.backward()

    # FPDT: this rank's chunks, the loss gathered over both ranks in FPDT's order.
    order = fpdt_token_order(SEQ, CHUNK * world, world, rank)
    gathered_order = torch.cat([fpdt_token_order(SEQ, CHUNK * world, world, r) for r in range(world)])
    fx, fw = x[order].clone().requires_grad_(), {k: v.clone().requires_grad_() for k, v in p.items()}
    attn = FPDT_Attention(config(), fw["w_qkv"], fw["b_qkv"], fw["w_out"], None, group, chunk_size=CHUNK * world)
    out, _ = attn(fx, None, None, rope)
    loss_all = FPDT_LogitsLoss.apply(out, labels[:, order], head, rank, world, group, 2)
    assert loss_all.shape == (SEQ, BATCH)
    loss = loss_all.mean()
    loss.backward()
    close("fpdt_out", out, ref_out.detach()[order])
    close("fpdt_loss", loss, ref_loss.detach())
    close("fpdt_dx", fx.grad, ref_x.grad[order])
    for k in p:
        close(f"fpdt_d{k}", _summed(fw[k].grad), ref_w[k].grad)

    # Ulysses: contiguous halves, DistributedAttention around plain causal attention.
    def local_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        s = q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM)
        s = s.masked_fill(torch.ones(s.shape[-1], s.shape[-1], dtype=torch.bool).triu(1), float("-inf"))
        return (s.softmax(-1) @ v).permute(2, 0, 1, 3)

    mine = slice(rank * SEQ // world, (rank + 1) * SEQ // world)
    ux, uw = x[mine].clone().requires_grad_(), {k: v.clone().requires_grad_() for k, v in p.items()}
    qkv = F.linear(ux, uw["w_qkv"], uw["b_qkv"])
    q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    q, k, v = (t.unflatten(-1, (-1, HEAD_DIM)) for t in (q, k, v))
    cos, sin = rope[0][mine], rope[1][mine]
    rot = lambda t: t * cos + torch.cat((-t.chunk(2, -1)[1], t.chunk(2, -1)[0]), -1) * sin  # noqa: E731
    u_out = DistributedAttention(local_attn, group, scatter_idx=2, gather_idx=0)(rot(q), rot(k), v, 1)
    u_out = u_out.flatten(2) @ uw["w_out"].t()
    u_loss = F.cross_entropy((u_out @ head.t()).flatten(0, 1), labels.t()[mine].flatten(), reduction="sum")
    (u_loss / (SEQ * BATCH)).backward()
    full_fpdt = torch.empty_like(ref_out)
    full_fpdt[gathered_order] = _gather(out.detach())
    close("ulysses_vs_fpdt_out", _gather(u_out.detach()), full_fpdt)
    full_fdx = torch.empty_like(x)
    full_fdx[gathered_order] = _gather(fx.grad)
    close("ulysses_vs_fpdt_dx", _gather(ux.grad), full_fdx)
    for k in p:
        close(f"ulysses_vs_fpdt_d{k}", _summed(uw[k].grad), _summed(fw[k].grad))

    # The layout all-to-all (DeepSpeed's `_SeqAllToAll`): 3 heads over 2 ranks (2 | 1), batch first.
    from ds_parallel.sequence.layer import _SeqAllToAll

    full = torch.randn(BATCH, SEQ, 3, HEAD_DIM, generator=gen, dtype=torch.float64)
    t = full[:, mine].clone().requires_grad_()
    s2h = _SeqAllToAll.apply(group, t, 2, 1, 0)
    close("a2a_s2h", s2h, full[:, :, [0, 1]] if rank == 0 else full[:, :, [2]])
    back = _SeqAllToAll.apply(group, s2h, 1, 2, 0, None, None, None, True, 3)
    close("a2a_round_trip", back, t.detach())
    close("a2a_round_trip_counted", _SeqAllToAll.apply(group, s2h, 1, 2, 0), t.detach())  # head counts exchanged
    (back * 2).sum().backward()
    close("a2a_grad", t.grad, torch.full_like(t, 2.0))
    return errs


def test_fpdt_sp2_matches_plain_attention_and_ulysses() -> None:
    results = run_ranks(2, _case, timeout_s=120)
    assert all(len(r) == 15 for r in results), results
    assert max(max(r.values()) for r in results) <= 1e-5
