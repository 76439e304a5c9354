"""The MoE layer on one rank: output = sum over kept routes of gate x expert(token) (written out per
token here), Residual-MoE mixing, DeepSpeed's parameter names and marks, and the optimizer group split."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ds_parallel.moe import MoE, is_moe_param, split_params_into_different_moe_groups_for_optimizer
from ds_parallel.moe.utils import configure_moe_param_groups, has_moe_layers

H = 6


def _expert() -> nn.Module:
    return nn.Sequential(nn.Linear(H, 10), nn.GELU(), nn.Linear(10, H))


def _reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    tokens = x.reshape(-1, H)
    routes = moe.deepspeed_moe.gate.route(tokens)
    experts = moe.deepspeed_moe.experts.deepspeed_experts
    rows = []
    for s in range(tokens.shape[0]):
        acc = torch.zeros(H)
        for r in range(routes.indices.shape[0]):
            e = int(routes.indices[r, s])
            if e >= 0:
                acc = acc + routes.gates[r, s] * experts[e](tokens[s])
        rows.append(acc)
    return torch.stack(rows).reshape(x.shape)


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("drop", [True, False])
def test_output_is_the_gate_weighted_sum_of_expert_outputs(k: int, drop: bool) -> None:
    torch.manual_seed(0)
    moe = MoE(
        H,
        _expert(),
        num_experts=4,
        k=k,
        capacity_factor=0.75,
        min_capacity=1,
        drop_tokens=drop,
        use_rts=False,
        top2_2nd_expert_sampling=False,
    )
    x = torch.randn(2, 9, H)
    out, l_aux, counts = moe(x)
    torch.testing.assert_close(out, _reference(moe, x), atol=1e-6, rtol=1e-5)
    assert int(counts.sum()) == 18 * k
    assert l_aux.requires_grad


def test_residual_moe_mixes_dense_and_expert_outputs_by_a_learned_coefficient() -> None:
    torch.manual_seed(1)
    moe = MoE(H, _expert(), num_experts=2, k=1, min_capacity=1, use_residual=True, use_rts=False)
    x = torch.randn(3, 4, H)
    out, _, _ = moe(x)
    coef = torch.softmax(moe.coefficient(x), dim=-1)
    expected = _reference(moe, x) * coef[..., :1] + moe.mlp(x) * coef[..., 1:]
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)


def test_gradients_reach_gate_experts_and_input() -> None:
    torch.manual_seed(2)
    moe = MoE(H, _expert(), num_experts=4, k=2, min_capacity=1, use_rts=False, top2_2nd_expert_sampling=False)
    x = torch.randn(2, 8, H, requires_grad=True)
    out, l_aux, _ = moe(x)
    (out.square().sum() + 0.1 * l_aux).backward()
    assert x.grad is not None and moe.deepspeed_moe.gate.wg.weight.grad is not None
    x2 = x.detach().clone().requires_grad_(True)
    ref = _reference(moe, x2)
    gate = moe.deepspeed_moe.gate.wg.weight
    g_out = torch.autograd.grad(ref.square().sum(), x2)[0]
    # l_aux's share of the input gradient is small but real; compare the output part alone.
    moe.zero_grad()
    x3 = x.detach().clone().requires_grad_(True)
    moe(x3)[0].square().sum().backward()
    torch.testing.assert_close(x3.grad, g_out, atol=1e-5, rtol=1e-5)
    assert gate.grad is not None


def test_parameter_names_and_expert_marks_are_deepspeeds() -> None:
    moe = MoE(H, _expert(), num_experts=4, ep_size=2, k=1)
    names = dict(moe.named_parameters())
    assert "deepspeed_moe.gate.wg.weight" in names
    assert sorted({n.split(".")[3] for n in names if ".deepspeed_experts." in n}) == ["0", "1"]
    for name, p in names.items():
        expert = ".deepspeed_experts." in name
        assert is_moe_param(p) == expert
        if expert:
            assert p.allreduce is False and p.group_name == "ep_size_2"
    assert has_moe_layers(nn.Sequential(nn.Linear(H, H), moe)) == (True, 4)
    assert has_moe_layers(nn.Linear(H, H)) == (False, 0)


def test_split_param_groups_for_optimizer() -> None:
    model = nn.Sequential(nn.Linear(H, H), MoE(H, _expert(), num_experts=2, k=1))
    dense = list(model[0].parameters()) + [model[1].deepspeed_moe.gate.wg.weight]
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "g", "lr": 0.5}, max_group_size=70
    )
    # each expert is weight 60 + bias 10, weight 60 + bias 6: four groups of <= 70 elements
    assert [g["name"] for g in groups] == ["g"] + ["ep_size_1"] * 4
    assert groups[0]["params"] == dense and "moe" not in groups[0]
    assert all(g["moe"] and g["lr"] == 0.5 for g in groups[1:])
    assert sum(p.numel() for p in groups[1]["params"]) <= 70
    moe_params = [p for p in model.parameters() if is_moe_param(p)]
    assert [p for g in groups[1:] for p in g["params"]] == moe_params
    built = configure_moe_param_groups(list(model.parameters()))
    assert [g["name"] for g in built] == ["dense-params", "ep_size_1"]


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match=r"num_experts \(3\).*ep_size \(2\)"):
        MoE(H, _expert(), num_experts=3, ep_size=2)
    with pytest.raises(ValueError, match="noisy_gate_policy"):
        MoE(H, _expert(), num_experts=2, noisy_gate_policy="Gaussian")
    with pytest.raises(TypeError, match="param-group dicts"):
        configure_moe_param_groups([1, 2])
    with pytest.raises(KeyError, match="no 'name'"):
        split_params_into_different_moe_groups_for_optimizer({"params": list(MoE(H, _expert(), 2).parameters())})
