"""FPDT on one process equals plain attention / FFN / cross entropy: outputs and gradients to 1e-5 (float64).

The SP=2 cases (against plain attention and against Ulysses) are in tests/dist/test_fpdt_dist.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from fpdt_reference import HIDDEN, attention_block, config, params, rotary

from ds_parallel.sequence import FPDT_FFN, FPDT_Attention, FPDT_InputConstruct, FPDT_LogitsLoss

TOL = {"atol": 1e-5, "rtol": 1e-5}


def _grads(loss: torch.Tensor, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, leaves))


@pytest.mark.parametrize("use_rope", [True, False])
@pytest.mark.parametrize("chunk_size", [4, 16])
def test_attention_matches_plain(use_rope: bool, chunk_size: int) -> None:
    seq, batch = 16, 2
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(seq, batch, HIDDEN, generator=gen, dtype=torch.float64)
    p = params()
    rope = rotary(seq) if use_rope else None
    leaves = [x.clone().requires_grad_(), *(t.clone().requires_grad_() for t in p.values())]
    attn = FPDT_Attention(config(), leaves[1], leaves[2], leaves[3], None, None, chunk_size=chunk_size)
    out, bias = attn(leaves[0], None, None, rope)
    assert bias is None and attn.num_chunks_attn == seq // chunk_size
    ref_leaves = [x.clone().requires_grad_(), *(t.clone().requires_grad_() for t in p.values())]
    ref = attention_block(ref_leaves[0], dict(zip(p, ref_leaves[1:], strict=True)), rope)
    torch.testing.assert_close(out, ref, **TOL)
    weight = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    for got, want in zip(_grads((out * weight).sum(), leaves), _grads((ref * weight).sum(), ref_leaves), strict=True):
        torch.testing.assert_close(got, want, **TOL)


def test_ffn_and_logits_loss_match_plain() -> None:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(12, 2, HIDDEN, generator=gen, dtype=torch.float64)
    w1, b1 = torch.randn(64, HIDDEN, generator=gen, dtype=torch.float64), torch.randn(64, generator=gen).double()
    w2, b2 = torch.randn(HIDDEN, 64, generator=gen, dtype=torch.float64), torch.randn(HIDDEN, generator=gen).double()
    leaves = [t.clone().requires_grad_() for t in (x, w1, b1, w2, b2)]
    out, bias = FPDT_FFN.apply(*leaves, True, 4)
    ref_leaves = [t.clone().requires_grad_() for t in (x, w1, b1, w2, b2)]
    xr, w1r, b1r, w2r, b2r = ref_leaves
    ref = F.linear(F.gelu(F.linear(xr, w1r, b1r), approximate="tanh"), w2r, b2r)
    assert bias is None
    torch.testing.assert_close(out, ref, **TOL)
    for got, want in zip(_grads((out**2).sum(), leaves), _grads((ref**2).sum(), ref_leaves), strict=True):
        torch.testing.assert_close(got, want, **TOL)

    vocab = 29
    h, w = x.clone().requires_grad_(), torch.randn(vocab, HIDDEN, generator=gen, dtype=torch.float64)
    w.requires_grad_()
    labels = torch.randint(0, vocab, (2, 12), generator=gen)
    loss = FPDT_LogitsLoss.apply(h, labels, w, 0, 1, None, 3)  # [s, b]
    hr, wr = x.clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = F.cross_entropy((hr @ wr.t()).flatten(0, 1), labels.t().flatten(), reduction="none").view(12, 2)
    torch.testing.assert_close(loss, ref, **TOL)
    for got, want in zip(_grads(loss.mean(), [h, w]), _grads(ref.mean(), [hr, wr]), strict=True):
        torch.testing.assert_close(got, want, **TOL)


def test_input_construct_layout() -> None:
    tokens = torch.arange(16).unsqueeze(0)
    args = SimpleNamespace(ds_sequence_parallel_fpdt_chunk_size=4)
    got = [FPDT_InputConstruct(tokens, tokens, tokens, None, tokens, args, 2, r).generate() for r in (0, 1)]
    # global chunks of 4 tokens, split in halves of 2: rank 0 holds the first half of each, rank 1 the second
    assert got[0][0].tolist() == [[0, 1, 4, 5, 8, 9, 12, 13]]
    assert got[1][0].tolist() == [[2, 3, 6, 7, 10, 11, 14, 15]]
    assert got[0][2].tolist() == [[0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15]]  # the gathered loss order
    with pytest.raises(ValueError, match="ds_sequence_parallel_fpdt_chunk_size=5"):
        FPDT_InputConstruct(
            tokens, None, None, None, None, SimpleNamespace(ds_sequence_parallel_fpdt_chunk_size=5), 2, 0
        )


def test_bad_chunking_is_refused_by_name() -> None:
    p = params()
    attn = FPDT_Attention(config(), p["w_qkv"], p["b_qkv"], p["w_out"], None, None, chunk_size=5)
    with pytest.raises(ValueError, match="chunk_size=5"):
        attn(torch.zeros(16, 1, HIDDEN, dtype=torch.float64))
