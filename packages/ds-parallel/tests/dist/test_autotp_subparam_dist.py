"""Sub-parameter layers on 2 gloo ranks compute a plain `nn.Linear` on the same weights: a fused q/k/v
(uneven sections) column layer feeding a row layer whose input is two sub-parameters, trained one step;
forward, input gradient and weight gradients match the unsharded reference, `gather_params` rebuilds the
whole weights, and every rank records the same universal-checkpoint description."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from ds_comm.testing import run_ranks


def _run(rank: int, world: int) -> dict[str, Any]:
    from ds_parallel import build_mesh
    from ds_parallel import tensor as tp

    torch.manual_seed(0)
    qkv_ref, out_ref = nn.Linear(5, 12), nn.Linear(12, 4)
    x = torch.randn(3, 5, requires_grad=True)
    (out_ref(torch.tanh(qkv_ref(x)))).square().sum().backward()
    ref_grad_x = x.grad.clone()  # type: ignore[union-attr]
    x.grad = None

    group = build_mesh(tp=world).group("tp")
    qkv = tp.SubParamLinearLayer(
        _copy(qkv_ref), group, shape=((6, 3, 3), -1), partition_dim=0, name="qkv", training=True
    )
    # The row layer's input is the column layer's output, which holds this rank's piece of q, k and v.
    out = tp.SubParamLinearAllreduce(
        _copy(out_ref), group, shape=(4, (6, 3, 3)), partition_dim=1, name="o_proj", training=True
    )
    y = out(torch.tanh(qkv(x)))
    y.square().sum().backward()
    torch.testing.assert_close(y, out_ref(torch.tanh(qkv_ref(x))), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, ref_grad_x, rtol=1e-5, atol=1e-6)
    for layer, ref in ((qkv, qkv_ref), (out, out_ref)):
        for pname in layer.layouts:
            grad = getattr(layer, pname).grad
            torch.testing.assert_close(grad, layer.shard_like(pname, getattr(ref, pname).grad), rtol=1e-5, atol=1e-6)
    shard_shape = tuple(qkv.weight.shape)
    qkv.gather_params([qkv.weight, qkv.bias])
    torch.testing.assert_close(qkv.weight.detach(), qkv_ref.weight.detach(), rtol=0, atol=0)
    torch.testing.assert_close(qkv.bias.detach(), qkv_ref.bias.detach(), rtol=0, atol=0)  # type: ignore[union-attr]
    model = nn.Module()
    model.qkv, model.o_proj = qkv, out
    qkv._tp_partition([qkv.weight, qkv.bias])
    assert tuple(qkv.weight.shape) == shard_shape
    return {"info": tp.collect_autotp_universal_checkpoint_info(model), "shard": shard_shape}


def _copy(linear: nn.Linear) -> nn.Linear:
    twin = nn.Linear(linear.in_features, linear.out_features)
    twin.load_state_dict(linear.state_dict())
    return twin


@pytest.mark.timeout(300)
def test_subparam_layers_match_linear_on_two_ranks() -> None:
    results = run_ranks(2, _run, timeout_s=240)
    assert results[0]["info"] == results[1]["info"]
    assert [r["shard"] for r in results] == [(7, 5), (5, 5)]  # q 3 + k 2 + v 2, and q 3 + k 1 + v 1
    info = results[0]["info"]
    assert info["parameter_with_row_parallelism_patterns"] == [r"^o_proj\.weight$"]
    assert info["tp_replicated_parameter_patterns"] == [r"^o_proj\.bias$"]
    assert info["sub_param_shard_widths"][r"^qkv\.weight$"] == [[3, 3], [2, 1], [2, 1]]
