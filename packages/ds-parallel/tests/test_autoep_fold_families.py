"""DeepSpeed's per-family gradient corrections for folded AutoEP, as a classification (`_fold_families`).

Each case is DeepSpeed 0.19.8's answer for that family and mode; ds's own engine applies none of them (its
folded dispatch gives exact gradients, tested in ds-engine's `dist/test_dist_autoep_folding.py`), but the
names and the router mark an `AutoEPMoELayer` carries must agree with DeepSpeed's.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ds_parallel.autoep import (
    AUTOEP_FOLDING_GRAD_REDUCE_AVERAGE as AVERAGE,
)
from ds_parallel.autoep import (
    AUTOEP_FOLDING_GRAD_REDUCE_EXPERT_TP_CANCEL as CANCEL,
)
from ds_parallel.autoep import (
    AUTOEP_FOLDING_GRAD_REDUCE_SKIP as SKIP,
)
from ds_parallel.autoep import (
    AUTOEP_FOLDING_GRAD_REDUCE_SUM as SUM,
)
from ds_parallel.autoep import (
    autoep_folding_gradient_reduction_strategy,
    mark_autoep_folding_partial_router_parameter,
    mark_autoep_folding_router_parameter,
    mark_autoep_folding_sp_sharded_layernorm_parameter,
)


def _spec(mode: str = "tp", tp: int = 2) -> SimpleNamespace:
    return SimpleNamespace(tp_size=tp, mp_mode=mode)


def _param(mark=None, **attrs) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.ones(2))
    if mark is not None:
        mark(p)
    for key, value in attrs.items():
        setattr(p, key, value)
    return p


@pytest.mark.parametrize(
    ("param", "mode", "tp", "want"),
    [
        (_param(mark_autoep_folding_router_parameter), "tp", 2, AVERAGE),
        (_param(mark_autoep_folding_router_parameter), "sp", 2, AVERAGE),
        (_param(mark_autoep_folding_partial_router_parameter), "tp", 2, SUM),
        (_param(mark_autoep_folding_partial_router_parameter), "sp", 2, SUM),
        (_param(mark_autoep_folding_partial_router_parameter), "replicated", 2, AVERAGE),
        (_param(mark_autoep_folding_sp_sharded_layernorm_parameter), "sp", 2, SUM),
        (_param(mark_autoep_folding_sp_sharded_layernorm_parameter), "tp", 2, AVERAGE),
        (_param(), "tp", 2, AVERAGE),
        (_param(allreduce=False), "tp", 2, CANCEL),
        (_param(allreduce=False), "tp", 1, SKIP),
        (_param(tensor_model_parallel=True), "tp", 2, SKIP),
    ],
)
def test_each_family_gets_deepspeeds_correction(param, mode: str, tp: int, want: str) -> None:
    assert autoep_folding_gradient_reduction_strategy(_spec(mode, tp), param) == want


def test_unmarked_router_is_found_by_name_and_no_spec_means_skip() -> None:
    p = _param()
    assert autoep_folding_gradient_reduction_strategy(_spec(), p, param_name="m.mlp.router.gate.weight") == AVERAGE
    assert autoep_folding_gradient_reduction_strategy(None, p) == SKIP


def test_autoep_layer_marks_its_router() -> None:
    from ds_parallel.autoep import AutoEPOptions, convert_moe_model

    transformers = pytest.importorskip("transformers")
    cfg = transformers.MixtralConfig(
        vocab_size=16,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=2,
        num_experts_per_tok=1,
    )
    model = transformers.MixtralForCausalLM(cfg)
    convert_moe_model(model, AutoEPOptions(autoep_size=1), ep_rank=0, ep_group=None)
    layer = model.model.layers[0].mlp
    for p in layer.router.parameters():
        assert autoep_folding_gradient_reduction_strategy(_spec(), p) == AVERAGE
        assert p.ds_autoep_folding_param_family == "router_gate_replicated"
    for p in layer.experts.parameters():
        assert autoep_folding_gradient_reduction_strategy(_spec(), p) == CANCEL
