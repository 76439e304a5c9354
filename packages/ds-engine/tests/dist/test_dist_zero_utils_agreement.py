"""`deepspeed.runtime.zero.utils`' rank-agreement checks on 2 gloo ranks: agreement passes, divergence names both."""

from __future__ import annotations

from typing import Any

import pytest

from ds_comm.testing import run_ranks

pytest.importorskip("ds_zero", reason="deepspeed.runtime.zero needs ds-zero: pip install 'ds-engine[zero]'")


def _agreement(rank: int, world_size: int) -> dict[str, Any]:
    from ds_engine.runtime.zero import utils as zu

    out: dict[str, Any] = {"rank0_list": zu.get_lst_from_rank0([10 + rank, 20 + rank])}
    zu.assert_ints_same_as_other_ranks([7, 8, 9])  # same everywhere: no error
    # contents differ (lengths agree, so both ranks make both broadcasts), then only lengths differ
    checks = (
        (zu.assert_ints_same_as_other_ranks, [1, 2 + rank]),
        (zu.assert_lst_len_same_as_other_ranks, [1] * (1 + rank)),
    )
    for check, ints in checks:
        try:
            check(ints)
            out.setdefault("errors", []).append(None)
        except RuntimeError as error:
            out.setdefault("errors", []).append(str(error))
    return out


def test_rank_agreement_checks_on_two_ranks() -> None:
    results = run_ranks(2, _agreement, timeout_s=120)
    assert [r["rank0_list"] for r in results] == [[10, 20], [10, 20]]
    rank0, rank1 = results
    assert rank0["errors"] == [None, None]  # rank 0 always agrees with itself
    assert "rank 0 has [1, 2], rank 1 has [1, 3]" in rank1["errors"][0]
    assert "rank 0 has 1, rank 1 has 2" in rank1["errors"][1]
