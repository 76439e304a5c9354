"""AutoEP expert states of a ZeRO-1/2 checkpoint rejoined from per-data-parallel-rank fragments: for both rank
layouts, the whole `[num_experts, ...]` tensor equals the experts the ranks held, stacked by global expert (the
reference is built from a known full tensor cut the way the ranks own it); errors name what is wrong."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ds_engine._checkpoint.constants import CAT_DIM, EP_IS_EXPERT_PARAM, EP_NUM_EXPERTS, PARAM
from ds_engine._checkpoint.offline.autoep_zero12 import (
    autoep_zero12_dp_ranks,
    consolidate_autoep_zero12_expert_states,
    zero12_fragment_path,
)

_NAME = "model.layers.0.mlp.experts.w1"


def _write(tmp: Path, full: dict[str, torch.Tensor], ep: int, dp: int, data_first: bool) -> None:
    """Cut each state's `[E, 3, 2]` tensor: EP rank e's experts, split flat over its data-parallel group."""
    (tmp / "tmp" / _NAME / "0").mkdir(parents=True)
    local = full["fp32"].shape[0] // ep
    for state, tensor in full.items():
        for e in range(ep):
            ranks = autoep_zero12_dp_ranks(e, dp, ep, data_first)
            for rank, piece in zip(ranks, tensor[e * local : (e + 1) * local].flatten().chunk(len(ranks)), strict=True):
                torch.save(piece.clone(), zero12_fragment_path(str(tmp / "tmp"), _NAME, state, rank))
    for rank in range(dp):
        torch.save(torch.tensor(5), zero12_fragment_path(str(tmp / "tmp"), _NAME, "step", rank))


@pytest.mark.parametrize("data_first", [False, True])
@pytest.mark.parametrize(("ep", "dp"), [(2, 4), (4, 4), (2, 2)])
def test_states_rejoin_to_the_full_expert_tensors(tmp_path: Path, ep: int, dp: int, data_first: bool) -> None:
    full = {s: torch.randn(4, 3, 2) for s in ("fp32", "exp_avg", "exp_avg_sq")}
    _write(tmp_path, full, ep, dp, data_first)
    info = {_NAME: {"num_experts": 4, "num_local_experts": 4 // ep, "ep_size": ep}}
    out = tmp_path / "universal"
    consolidate_autoep_zero12_expert_states(
        str(tmp_path / "tmp"), str(out), info, {_NAME: (4 // ep, 3, 2)}, dp, 1, data_first
    )
    for state, tensor in full.items():
        entry = torch.load(out / "zero" / _NAME / f"{state}.pt", weights_only=False)
        torch.testing.assert_close(entry[PARAM], tensor, rtol=0, atol=0)
        assert (entry[CAT_DIM], entry[EP_IS_EXPERT_PARAM], entry[EP_NUM_EXPERTS]) == (0, True, 4)
    assert int(torch.load(out / "zero" / _NAME / "step.pt", weights_only=False)) == 5


def test_layouts_and_errors(tmp_path: Path) -> None:
    assert list(autoep_zero12_dp_ranks(1, 6, 2, False)) == [1, 3, 5]
    assert list(autoep_zero12_dp_ranks(1, 6, 2, True)) == [3, 4, 5]
    with pytest.raises(ValueError, match="degree 6 is not divisible by autoep_size 4"):
        autoep_zero12_dp_ranks(0, 6, 4, False)
    full = {s: torch.randn(4, 3, 2) for s in ("fp32", "exp_avg", "exp_avg_sq")}
    _write(tmp_path, full, 2, 4, False)
    info = {_NAME: {"num_experts": 4, "num_local_experts": 2, "ep_size": 2}}
    args = (str(tmp_path / "tmp"), str(tmp_path / "u"), info)
    with pytest.raises(RuntimeError, match=r"local shape \(3, 3, 2\) .* disagrees"):
        consolidate_autoep_zero12_expert_states(*args, {_NAME: (3, 3, 2)}, 4, 1, False)
    with pytest.raises(NotImplementedError, match="tensor parallelism"):
        consolidate_autoep_zero12_expert_states(*args, {_NAME: (2, 3, 2)}, 4, 2, False)
    zero12_fragment_path_ = Path(zero12_fragment_path(str(tmp_path / "tmp"), _NAME, "exp_avg", 2))
    zero12_fragment_path_.unlink()
    with pytest.raises(RuntimeError, match=r"exp_avg fragments of .* ranks \[0, 2\] hold 6 elements, expected 12"):
        consolidate_autoep_zero12_expert_states(*args, {_NAME: (2, 3, 2)}, 4, 1, False)
