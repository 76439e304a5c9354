"""Random-LTD's token sampling, gather and scatter against plain PyTorch indexing, values and gradients.

The reference builds the same result with Python-level indexing (`x[b, idx[b]]`) on a copy of the
inputs and lets autograd differentiate it; the custom functions must agree exactly (float64), in both
hidden-state orders, alone and chained as the random-LTD layer chains them.
"""

from __future__ import annotations

import pytest
import torch

from ds_engine._data.ltd_loops import bsh_decoder_gather, bsh_decoder_scatter
from ds_engine._data.token_ops import GatherTokens, ScatterTokens, bert_sample_tokens, gpt_sample_tokens

B, S, H, KEEP = 3, 9, 4, 5


def _to_bsh(x: torch.Tensor, batch_first: bool) -> torch.Tensor:
    return x if batch_first else x.transpose(0, 1)


def _ref_gather(x: torch.Tensor, idx: torch.Tensor, batch_first: bool) -> torch.Tensor:
    bsh = _to_bsh(x, batch_first)
    return _to_bsh(torch.stack([bsh[b, idx[b].long()] for b in range(idx.size(0))]), batch_first)


def _ref_scatter(x: torch.Tensor, part: torch.Tensor, idx: torch.Tensor, batch_first: bool) -> torch.Tensor:
    rows = []
    bsh, part_bsh = _to_bsh(x, batch_first), _to_bsh(part, batch_first)
    for b in range(idx.size(0)):
        keep = torch.zeros(bsh.size(1), dtype=torch.bool)
        keep[idx[b].long()] = True
        row = bsh[b].clone()
        row = torch.where(keep[:, None], torch.zeros_like(row), row)
        row = row.index_add(0, idx[b].long(), part_bsh[b])
        rows.append(row)
    return _to_bsh(torch.stack(rows), batch_first)


def test_sampled_positions_are_sorted_distinct_and_in_range() -> None:
    torch.manual_seed(0)
    indices, mask = gpt_sample_tokens(KEEP, S, B, layers=2, attn_mask=None)
    assert indices.shape == (2, B, KEEP) and indices.dtype == torch.int32 and mask is None
    for row in indices.reshape(-1, KEEP):
        assert torch.equal(row, row.sort().values) and len(set(row.tolist())) == KEEP
        assert 0 <= int(row.min()) and int(row.max()) < S


def test_gpt_mask_is_the_top_left_block() -> None:
    causal = torch.tril(torch.ones(S, S)).expand(B, 1, S, S)
    _, mask = gpt_sample_tokens(KEEP, S, B, attn_mask=causal)
    assert torch.equal(mask, causal[:, :, :KEEP, :KEEP])


def test_bert_mask_is_gathered_at_kept_rows_and_columns() -> None:
    torch.manual_seed(1)
    dense = torch.randn(B, 2, S, S)
    indices, masks = bert_sample_tokens(KEEP, S, B, layers=2, attn_mask=dense)
    assert len(masks) == 2
    for layer in range(2):
        for b in range(B):
            idx = indices[layer, b].long()
            assert torch.equal(masks[layer][b], dense[b][:, idx][:, :, idx])
    with pytest.raises(ValueError, match="model_mask_name"):
        bert_sample_tokens(KEEP, S, B, attn_mask=None)


@pytest.mark.parametrize("batch_first", [True, False])
def test_gather_and_scatter_match_indexing_with_gradients(batch_first: bool) -> None:
    torch.manual_seed(2)
    idx = gpt_sample_tokens(KEEP, S, B)[0][0]
    shape = (B, S, H) if batch_first else (S, B, H)
    part_shape = (B, KEEP, H) if batch_first else (KEEP, B, H)
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    part = torch.randn(part_shape, dtype=torch.float64, requires_grad=True)
    up_x, up_g = torch.randn(shape, dtype=torch.float64), torch.randn(part_shape, dtype=torch.float64)
    up_out = torch.randn(shape, dtype=torch.float64)

    same, gathered = GatherTokens.apply(x, idx, batch_first)
    scattered = ScatterTokens.apply(x, part, idx, batch_first)
    ((same * up_x).sum() + (gathered * up_g).sum() + (scattered * up_out).sum()).backward()

    rx, rpart = x.detach().clone().requires_grad_(), part.detach().clone().requires_grad_()
    r_gathered, r_scattered = _ref_gather(rx, idx, batch_first), _ref_scatter(rx, rpart, idx, batch_first)
    ((rx * up_x).sum() + (r_gathered * up_g).sum() + (r_scattered * up_out).sum()).backward()

    assert torch.equal(same, x) and torch.equal(gathered, r_gathered) and torch.equal(scattered, r_scattered)
    torch.testing.assert_close(x.grad, rx.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(part.grad, rpart.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("batch_first", [True, False])
def test_chained_layer_gradient_is_the_layers_at_kept_tokens(batch_first: bool) -> None:
    """Gather -> layer -> scatter, as RandomLayerTokenDrop runs it: kept tokens get the layer's gradient,
    dropped ones pass the incoming gradient through (what DeepSpeed's kernels give)."""
    torch.manual_seed(3)
    idx = gpt_sample_tokens(KEEP, S, B)[0][0]
    weight = torch.randn(H, H, dtype=torch.float64)
    shape = (B, S, H) if batch_first else (S, B, H)
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(shape, dtype=torch.float64)
    full, kept = GatherTokens.apply(x, idx, batch_first)
    (ScatterTokens.apply(full, torch.tanh(kept @ weight), idx, batch_first) * upstream).sum().backward()

    rx = x.detach().clone().requires_grad_()
    (
        _ref_scatter(rx, torch.tanh(_ref_gather(rx, idx, batch_first) @ weight), idx, batch_first) * upstream
    ).sum().backward()
    torch.testing.assert_close(x.grad, rx.grad, rtol=0, atol=1e-12)


def test_per_sequence_reference_gather_and_scatter() -> None:
    torch.manual_seed(4)
    x = torch.randn(B, S, H)
    mask = torch.tril(torch.ones(S, S)).expand(B, 1, S, S)
    kept, positions, part_mask = bsh_decoder_gather(KEEP, x, mask)
    assert kept.shape == (B, KEEP, H) and part_mask.shape == (B, 1, KEEP, KEEP)
    for b, where in enumerate(positions):
        assert torch.equal(kept[b], x[b, where]) and torch.equal(where, where.sort().values)
    out = bsh_decoder_scatter(x.clone(), kept * 2, positions)
    for b, where in enumerate(positions):
        assert torch.equal(out[b, where], 2 * x[b, where])
