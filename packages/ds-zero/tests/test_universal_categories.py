"""How `universal_checkpoint_info`'s categories merge tensor-parallel slices (`Categories.payload`), against
the whole tensor the slices were cut from: column (dim 0, also uneven), row (dim 1), replicated (equal
slices required), two stacked sub-parameters, fused sections, vocabulary padding; DeepSpeed's affine maps
(placed blocks, replicas checked, scales undone for fp32 only, newer versions refused); refused layouts name
their key."""

from __future__ import annotations

import pytest
import torch

from ds_zero._checkpoint.universal_categories import Categories

INFO = {
    "tp_replicated_parameter_patterns": [r"^norm\.weight$"],
    "parameter_with_row_parallelism_patterns": [r"^o_proj\.weight$"],
    "parameter_with_2_sub_params_cat_dim_0": [r"^gate_up\.weight$"],
    "vocabulary_parameter_patterns": [r"^embed\.weight$"],
    "original_vocab_size": 5,
}


def test_column_and_row_slices_concatenate_along_their_cut() -> None:
    whole = torch.randn(7, 4)
    cats = Categories(INFO)
    column = cats.payload("q_proj.weight", list(whole.split([4, 3], dim=0)))  # uneven: each rank's own shape
    assert column["cat_dim"] == 0 and torch.equal(column["param"], whole)
    row = cats.payload("o_proj.weight", list(whole.split([2, 2], dim=1)))
    assert row["cat_dim"] == 1 and torch.equal(row["param"], whole)
    assert list(column) == ["cat_dim", "param"]  # DeepSpeed's key order


def test_replicated_slices_must_agree() -> None:
    value = torch.randn(4)
    cats = Categories(INFO)
    assert cats.payload("norm.weight", [value, value.clone()]) == {"param": value}
    with pytest.raises(ValueError, match=r"'norm.weight'.*exp_avg differs between tensor-parallel ranks 0 and 1"):
        cats.payload("norm.weight", [value, value + 1e-7], "exp_avg")


def test_two_sub_params_and_vocabulary_padding() -> None:
    gate, up = torch.randn(6, 3), torch.randn(6, 3)
    slices = [torch.cat([gate[:3], up[:3]]), torch.cat([gate[3:], up[3:]])]  # each rank: its gate, its up
    out = Categories(INFO).payload("gate_up.weight", slices)
    assert torch.equal(out["param"], torch.cat([gate, up])) and out["param_n_sub_params"] == 2
    padded = torch.randn(8, 2)  # 5 real rows, 3 padding, cut in two
    vocab = Categories(INFO).payload("embed.weight", list(padded.chunk(2)))
    assert vocab["vocab_tensor"] and torch.equal(vocab["param"], padded[:5])


def test_one_slice_is_the_parameter_and_unused_patterns_are_tracked() -> None:
    cats = Categories(INFO)
    value = torch.randn(3, 2)
    assert torch.equal(cats.payload("fc.weight", [value])["param"], value)
    patterns = {r"^norm\.weight$", r"^o_proj\.weight$", r"^gate_up\.weight$", r"^embed\.weight$"}
    assert cats.unused == patterns
    cats.payload("norm.weight", [torch.ones(2)])
    assert cats.unused == patterns - {r"^norm\.weight$"}


def _column_map(rows: int, cols: int) -> dict:
    """An affine map (DeepSpeed's encoding) of a [rows, cols] weight cut in two along dim 0."""
    half = rows // 2 * cols
    piece = {"shape": [rows // 2, cols], "dest": [0, [cols, 1]], "locations": [0]}
    return {
        "logical_shape": [rows, cols],
        "ranks": {
            0: {"shard_shape": [rows // 2, cols], "pieces": [{**piece, "source": [0, [cols, 1]]}]},
            1: {"shard_shape": [rows // 2, cols], "pieces": [{**piece, "source": [half, [cols, 1]], "locations": [1]}]},
        },
    }


def _replicated_map(size: int, scale: float = 1.0) -> dict:
    piece = {"shape": [size], "source": [0, [1]], "dest": [0, [1]], "locations": [0, 1]}
    if scale != 1.0:
        piece["scale"] = scale
    return {"logical_shape": [size], "ranks": {r: {"shard_shape": [size], "pieces": [piece]} for r in (0, 1)}}


def test_an_affine_map_places_the_slices_and_supersedes_the_categories() -> None:
    whole = torch.randn(6, 3)
    info = {**INFO, "affine_map": {"version": 1, "params": {r"^o_proj\.weight$": _column_map(6, 3)}}}
    cats = Categories(info)
    out = cats.payload("o_proj.weight", list(whole.chunk(2)))  # a row-parallel pattern too: the map wins
    assert list(out) == ["param"] and torch.equal(out["param"], whole)
    assert r"^o_proj\.weight$" not in cats.unused


def test_an_affine_map_checks_replicas_and_undoes_scales_of_fp32_only() -> None:
    value = torch.randn(4)
    maps = {r"^norm\.weight$": _replicated_map(4), r"^bias$": _replicated_map(4, scale=0.5)}
    cats = Categories({"affine_map": {"version": 1, "params": maps}})
    assert torch.equal(cats.payload("norm.weight", [value, value.clone()])["param"], value)
    with pytest.raises(ValueError, match="hold different exp_avg for one replicated block"):
        cats.payload("norm.weight", [value, value + 1], "exp_avg")
    assert torch.equal(cats.payload("bias", [value * 0.5, value * 0.5])["param"], value)
    with pytest.raises(ValueError, match="exp_avg passes through a block scaled by 0.5"):
        cats.payload("bias", [value, value], "exp_avg")
    with pytest.raises(ValueError, match="newer than this converter"):
        Categories({"affine_map": {"version": 2, "params": {}}})


def test_fused_projections_merge_per_section_and_unconvertible_parameters_are_refused() -> None:
    whole = torch.randn(8, 2)
    q, k, v = whole.split([4, 2, 2])
    slices = [torch.cat([q[:2], k[:1], v[:1]]), torch.cat([q[2:], k[1:], v[1:]])]
    fused = {"parameter_with_sub_params": [{"patterns": [r"^qkv$"], "shape": [(4, 2, 2), -1], "partition_dim": 0}]}
    payload = Categories(fused).payload("qkv", slices)
    assert torch.equal(payload["param"], whole) and payload["sub_param_shape"]["shape"] == ((4, 2, 2), -1)
    with pytest.raises(ValueError, match="shard widths describe"):  # slices of another parameter
        Categories(fused).payload("qkv", [torch.ones(3, 2), torch.ones(5, 2)])
    with pytest.raises(ValueError, match=r"\^x\$: fused heads"):
        Categories({"autotp_unsupported_parameter_patterns": {"^x$": "fused heads"}})
