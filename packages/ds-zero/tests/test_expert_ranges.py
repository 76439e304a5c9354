"""AutoEP expert ranges read across expert-parallel degrees: a synthetic save of one stacked expert tensor of
4 experts at `autoep_size` 1, 2 or 4 (each range split over 1 or 2 expert-data-parallel ranks) is read back as
the ranges of every other degree, values and optimizer state, element for element."""

from __future__ import annotations

import pytest
import torch

from ds_zero._checkpoint.expert_ranges import ExpertRanges, expert_range
from ds_zero._checkpoint.format import FORMAT_VERSION, FragmentIndex, fill_partition, fp32_param_values
from ds_zero._partition import Fragment, padded_numel

EXPERTS = 4
WHOLE = torch.arange(EXPERTS * 2 * 3, dtype=torch.float32).reshape(EXPERTS, 2, 3)


def _name(lo: int, hi: int) -> str:
    return f"layers.0.mlp.experts.w1@experts{lo}:{hi}"


def _save(ep: int, edp: int) -> list[dict]:
    """What `ep * edp` ranks save: rank r holds expert range `r // edp`, split over its `edp` ranks."""
    local = EXPERTS // ep
    numel = local * 6
    part = padded_numel(numel, edp) // edp
    out = []
    for r in range(ep * edp):
        ep_rank, edp_rank = divmod(r, edp)
        lo, hi = ep_rank * local, (ep_rank + 1) * local
        flat = WHOLE[lo:hi].reshape(-1)
        start = edp_rank * part
        held = flat[start : start + part]
        values = torch.cat([held, torch.zeros(part - held.numel())])
        frag = Fragment(_name(lo, hi), start, held.numel(), 0)
        out.append(
            {
                "ds_zero_format": FORMAT_VERSION,
                "zero_stage": 3,
                "partition_count": ep * edp,
                "dp_rank": r,
                "single_partition_of_fp32_groups": [values],
                "partitions": [
                    {
                        "group_index": 0,
                        "numel": part,
                        "padding": part - held.numel(),
                        "fragments": [frag.to_list()],
                        "param_shapes": {_name(lo, hi): [local, 2, 3]},
                    }
                ],
                "base_optimizer_state": {
                    "state": {0: {"exp_avg": values * 2, "step": torch.tensor(3.0)}},
                    "param_groups": [{"lr": 0.1, "params": [0]}],
                },
            }
        )
    return out


SAVES = [(1, 1), (1, 2), (2, 1), (2, 2), (4, 1)]


@pytest.mark.parametrize(("ep", "edp"), SAVES)
@pytest.mark.parametrize("want_ep", [1, 2, 4])
def test_every_range_of_another_degree_reads_its_rows(ep: int, edp: int, want_ep: int) -> None:
    saved = _save(ep, edp)
    local = EXPERTS // want_ep
    names = [_name(e * local, (e + 1) * local) for e in range(want_ep)]
    values = fp32_param_values(saved, names)
    for e, name in enumerate(names):
        assert torch.equal(values[name], WHOLE[e * local : (e + 1) * local]), name


@pytest.mark.parametrize(("ep", "edp"), SAVES)
def test_a_slice_of_a_range_fills_a_partition_with_values_and_state(ep: int, edp: int) -> None:
    """Elements [3, 10) of experts 1..2 (rows 1-2 of the whole tensor), as a new rank's fragment at offset 2."""
    saved = _save(ep, edp)
    index = FragmentIndex(saved)
    frag = Fragment(_name(1, 3), 3, 7, 2)
    want = WHOLE[1:3].reshape(-1)[3:10]
    dst = torch.full((10,), -1.0)
    fill_partition(dst, [frag], index, lambda rank, k: saved[rank]["single_partition_of_fp32_groups"][k])
    assert torch.equal(dst[2:9], want) and torch.equal(dst[:2], torch.zeros(2)) and dst[9] == 0
    fill_partition(dst, [frag], index, lambda rank, k: saved[rank]["base_optimizer_state"]["state"][k]["exp_avg"])
    assert torch.equal(dst[2:9], want * 2)


def test_a_range_the_save_does_not_cover_is_refused_naming_it() -> None:
    saved = _save(2, 1)[:1]  # only experts 0..1 (rank 0 of a save, re-labelled as a 1-rank save)
    saved[0]["partition_count"] = 1
    index = FragmentIndex(saved)
    assert index.shape_of(_name(0, 1)) == (1, 2, 3)
    assert index.shape_of(_name(1, 3)) is None
    with pytest.raises(ValueError, match=r"w1@experts1:3.*not in the checkpoint"):
        fill_partition(torch.empty(6), [Fragment(_name(1, 3), 0, 6, 0)], index, lambda rank, k: torch.empty(0))
    with pytest.raises(ValueError, match=r"w1@experts0:4.*not in the checkpoint"):
        fp32_param_values(saved, [_name(0, 4)])


def test_ranges_with_other_row_shapes_or_gaps_do_not_resolve() -> None:
    ranges = ExpertRanges({_name(0, 2): (2, 2, 3), _name(2, 4): (2, 3, 2), "b": (5,)})
    assert ranges.shape(_name(0, 2)) == (2, 2, 3)
    assert ranges.shape(_name(1, 3)) is None  # rows 1 and 2 have different shapes
    gap = ExpertRanges({_name(0, 1): (1, 2, 3), _name(2, 3): (1, 2, 3)})
    assert gap.shape(_name(0, 3)) is None and gap.pieces(_name(0, 3), 0, 18) == []
    assert gap.pieces(_name(2, 3), 4, 2) == [(_name(2, 3), 4, 0, 2)]
    assert expert_range("b") is None and expert_range(_name(1, 3)) == ("layers.0.mlp.experts.w1", 1, 3)
