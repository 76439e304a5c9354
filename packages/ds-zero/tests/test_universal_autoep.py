"""The AutoEP universal writer's pieces: expert-range names, joining ranges into whole expert tensors, refusals."""

from __future__ import annotations

import pytest
import torch

from ds_zero._checkpoint.universal_autoep import _join, autoep_layers, expert_range


def test_expert_range_parses_ds_names() -> None:
    assert expert_range("model.layers.0.mlp.experts.w1@experts2:4") == ("model.layers.0.mlp.experts.w1", 2, 4)
    assert expert_range("model.layers.0.mlp.experts.w1") is None
    assert expert_range("lm_head.weight") is None


def test_autoep_layers_reads_both_keys() -> None:
    entry = {"expert_key_prefix": "m.experts", "num_experts": 4}
    assert autoep_layers({"ds_autoep_layers": [entry]}) == [entry]
    assert autoep_layers({"autoep_layers": [entry]}) == [entry]
    assert autoep_layers({"ds_autoep_layers": None}) == []


def test_join_stacks_ranges_in_expert_order() -> None:
    rows = torch.arange(4 * 3, dtype=torch.float32).view(4, 3)
    moments = -rows

    def states(lo: int, hi: int) -> dict[str, object]:
        return {"fp32": rows[lo:hi].reshape(-1), "exp_avg": moments[lo:hi].reshape(-1), "step": 7}

    joined = _join("m.experts.w1", [(2, 4, states(2, 4)), (0, 2, states(0, 2))], 4)
    assert sorted(joined) == ["exp_avg", "fp32"]  # the step is not a per-expert tensor
    torch.testing.assert_close(joined["fp32"].view(4, 3), rows, rtol=0, atol=0)
    torch.testing.assert_close(joined["exp_avg"].view(4, 3), moments, rtol=0, atol=0)


def test_join_refuses_ranges_that_do_not_tile_the_experts() -> None:
    part = {"fp32": torch.zeros(6)}
    with pytest.raises(ValueError, match=r"saved expert ranges \[\(0, 2\)\] do not tile its 4 experts"):
        _join("m.experts.w1", [(0, 2, part)], 4)
    with pytest.raises(ValueError, match="do not tile"):
        _join("m.experts.w1", [(0, 1, part), (1, 4, part)], 4)  # uneven ranges: not one expert-parallel layout
