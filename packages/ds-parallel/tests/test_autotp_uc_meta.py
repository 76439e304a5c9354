"""AutoTP layers record how they cut each parameter (DeepSpeed's universal-checkpoint schema), and
`collect_autotp_universal_checkpoint_info` turns the records into DeepSpeed's model-level dict. The new
DeepSpeed-named layers compute what a plain `nn.Linear` computes on the same weights (one rank)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ds_parallel import tensor as tp


def _model(**layers: nn.Module) -> nn.Module:
    model = nn.Module()
    for name, layer in layers.items():
        setattr(model, name, layer)
    return model


def test_row_and_column_records() -> None:
    col = tp.LinearLayer(nn.Linear(6, 10), None, name="up")
    row = tp.LinearAllreduce(nn.Linear(10, 6), None, name="down")
    meta = getattr(col.weight, tp.DS_AUTOTP_UC_META)
    assert meta["partition_type"] == "column" and meta["partition_dim"] == 0
    assert meta["partition_sizes"] == (10,) and meta["logical_shape"] == (10, 6)
    assert meta["conversion"]["original_shape"] == (10, 6)
    rmeta = getattr(row.bias, tp.DS_AUTOTP_UC_META)
    assert rmeta["replicated"] and rmeta["partition_dim"] is None and rmeta["is_bias"]
    norm = nn.LayerNorm(6)
    info = tp.collect_autotp_universal_checkpoint_info(_model(up=col, down=row, norm=norm))
    assert info["parameter_with_row_parallelism_patterns"] == [r"^down\.weight$"]
    assert info["tp_replicated_parameter_patterns"] == [r"^down\.bias$", r"^norm\.bias$", r"^norm\.weight$"]
    assert info["parameter_with_sub_params"] == [] and info["vocabulary_parameter_patterns"] == []
    assert info["universal_checkpoint_version"] == 0.4


def test_frozen_uneven_split_is_recorded() -> None:
    layer = tp.LinearLayer(nn.Linear(4, 7), None, name="mlp.up_proj")
    layer.tp_world_size = 3
    assert layer._freeze_partition_sizes(7) == (3, 2, 2)
    layer._mark_uc_metadata()
    assert getattr(layer.bias, tp.DS_AUTOTP_UC_META)["partition_sizes"] == (3, 2, 2)
    with pytest.raises(ValueError, match="not 8"):
        layer._freeze_partition_sizes(8)


def test_vocabulary_and_tied_alias() -> None:
    head = tp.LinearLayer(nn.Linear(4, 20, bias=False), None, name="lm_head")
    model = _model(lm_head=head, out=nn.Linear(4, 20, bias=False))
    model.out.weight = head.weight  # type: ignore[union-attr]
    info = tp.collect_autotp_universal_checkpoint_info(model)
    assert info["vocabulary_parameter_patterns"] == [r"^lm_head\.weight$"]
    assert info["original_vocab_size"] == 20
    assert not any("out" in p for p in info["tp_replicated_parameter_patterns"])


def test_gate_up_sections_are_sub_params() -> None:
    layer = tp.GateUpPack_LinearLayer(nn.Linear(3, 10), None, name="gate_up_proj")
    layer.tp_world_size = 2
    layer._freeze_partition_sizes(10)
    layer._mark_uc_metadata()
    info = tp.collect_autotp_universal_checkpoint_info(_model(g=layer))
    assert info["parameter_with_sub_params"][0] == {
        "patterns": [r"^g\.weight$"],
        "shape": [(5, 5), 3],
        "partition_dim": 0,
    }
    assert info["sub_param_shard_widths"][r"^g\.bias$"] == [[3, 2], [3, 2]]


@pytest.mark.parametrize(
    ("shape", "dim", "sizes"),
    [((3, -1), 0, (4, 4, 4)), (((6, 3, 3), -1), 0, (6, 3, 3)), ((2, (2, 4), -1), 1, (2, 4))],
)
def test_subparam_layer_matches_linear(shape: tuple[object, ...], dim: int, sizes: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    ref = nn.Linear(5, 12)
    layer = tp.SubParamLinearLayer(ref, None, shape=shape, partition_dim=dim, name="qkv")
    x = torch.randn(3, 5)
    torch.testing.assert_close(layer(x), ref(x), rtol=0, atol=0)
    meta = getattr(layer.weight, tp.DS_AUTOTP_UC_META)
    assert meta["sub_param_sizes"] == sizes


def test_subparam_cut_over_ranks_rebuilds() -> None:
    """Cut as two ranks would: each rank holds its piece of q, k and v; the shards unshard to the whole."""
    ref = nn.Linear(2, 12)
    layer = tp.SubParamLinearLayer(ref, None, shape=((6, 3, 3), -1), partition_dim=0, name="qkv")
    layer.tp_world_size = 2
    layer._freeze_partition_sizes(12)
    widths = layer._subparam_shard_widths
    assert [sum(w) for w in widths] == [6, 3, 3]
    whole = ref.weight.detach()
    shards = [layer.layouts["weight"].shard(whole, r) for r in range(2)]
    q, k, v = whole.split([6, 3, 3])
    expected0 = torch.cat([q[: widths[0][0]], k[: widths[1][0]], v[: widths[2][0]]])
    assert torch.equal(shards[0], expected0)
    assert torch.equal(layer.layouts["weight"].unshard(shards), whole)


def test_subparam_allreduce_and_bad_shape() -> None:
    ref = nn.Linear(6, 4)
    layer = tp.SubParamLinearAllreduce(ref, None, shape=(4, (2, 4)), partition_dim=1, name="o")
    x = torch.randn(2, 6)
    torch.testing.assert_close(layer(x), ref(x))
    assert getattr(layer.bias, tp.DS_AUTOTP_UC_META)["replicated"]
    with pytest.raises(ValueError, match="'bad'"):
        tp.SubParamLinearLayer(nn.Linear(5, 12), None, shape=(5, -1), partition_dim=0, name="bad")


def test_yuan_and_fused_forward_and_unsupported() -> None:
    ref = nn.Linear(8, 8)
    x = torch.randn(2, 8)
    for cls in (tp.Yuan_LinearLayer, tp.Yuan_LinearAllreduce):
        layer = cls(ref, None, name="v_proj")
        torch.testing.assert_close(layer(x), ref(x))
    block = type("GLMBlock", (nn.Module,), {})()
    fused = tp.fused_LinearLayer(nn.Linear(4, 12), None, fused_module=block, name="query_key_value")
    assert fused.interleaved is False
    info = tp.collect_autotp_universal_checkpoint_info(_model(f=fused))
    assert info["autotp_unsupported_parameter_patterns"] == {}
    with pytest.raises(ValueError, match="fused_module"):
        tp.fused_LinearLayer(nn.Linear(4, 12), None, name="qkv")


def test_zero3_emptied_module_keeps_its_whole_shape() -> None:
    lin = nn.Linear(6, 4)
    lin.weight.ds_shape = lin.weight.shape  # type: ignore[attr-defined]
    lin.weight.data = torch.empty(0)
    layer = tp.LinearLayer(lin, None, name="up")
    assert getattr(layer.weight, tp.DS_AUTOTP_UC_META)["original_shape"] == (4, 6)


def test_yuan_cut_takes_each_rank_its_paired_value_heads() -> None:
    """8 heads of 2 features over 2 ranks: rank r holds value heads 2r, 2r+1 (first half) and 4+2r, 5+2r."""
    meta = tp.TPMeta(num_kv_heads=8)
    layer = tp.Yuan_LinearLayer(nn.Linear(4, 16), None, name="v_proj", tp_meta=meta)
    layer.tp_world_size = 2
    layer._freeze_partition_sizes(16)
    whole = torch.arange(16.0 * 4).view(16, 4)
    for rank in range(2):
        heads = [2 * rank, 2 * rank + 1, 4 + 2 * rank, 5 + 2 * rank]
        expected = torch.cat([whole[2 * h : 2 * h + 2] for h in heads])
        assert torch.equal(layer.layouts["weight"].shard(whole, rank), expected)
    with pytest.raises(ValueError, match="even number of heads per rank"):
        layer.tp_world_size = 8  # one head per rank: its pair would straddle two ranks
        layer._freeze_partition_sizes(16)
