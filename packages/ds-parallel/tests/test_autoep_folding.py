"""AutoEP+AutoTP folding as arithmetic: group tables against a tensor-reshape reference, the sizes' checks, the
global rules and the stale-registry check; and the fused gate+up layout classifier.

The reference for a stage is `arange(stage).reshape(dp, tp)` (rows: TP groups, columns: dense DP groups) and
`arange(stage).reshape(edp, ep)` (rows: EP groups, columns: EDP groups), offset per pipeline stage.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ds_parallel.autoep import (
    FoldingGroupHandles,
    assert_group_matches_spec,
    build_folding_spec,
    classify_fused_gate_up_layout,
    expected_folding_group_tables,
    local_folding_ranks,
    validate_folding_global,
)


def _rows(t: torch.Tensor) -> set[tuple[int, ...]]:
    return {tuple(int(x) for x in row) for row in t}


@pytest.mark.parametrize(
    ("world", "pp", "tp", "ep"), [(8, 1, 2, 4), (16, 1, 2, 8), (4, 1, 4, 4), (4, 1, 2, 4), (8, 2, 2, 2), (6, 1, 3, 2)]
)
def test_tables_match_a_reshape_reference(world: int, pp: int, tp: int, ep: int) -> None:
    spec = build_folding_spec(world_size=world, pp_size=pp, tp_size=tp, ep_size=ep)
    tables = expected_folding_group_tables(spec)
    stage = world // pp
    assert (spec.stage_size, spec.dp_size, spec.edp_size) == (stage, stage // tp, stage // ep)
    want: dict[str, set[tuple[int, ...]]] = {"tp": set(), "dp": set(), "ep": set(), "edp": set()}
    for s in range(pp):
        grid = torch.arange(s * stage, (s + 1) * stage)
        want["tp"] |= _rows(grid.reshape(-1, tp))
        want["dp"] |= _rows(grid.reshape(-1, tp).T)
        want["ep"] |= _rows(grid.reshape(-1, ep))
        want["edp"] |= _rows(grid.reshape(-1, ep).T)
    assert set(tables.tp_groups) == want["tp"] and set(tables.dense_dp_groups) == want["dp"]
    assert set(tables.ep_groups) == want["ep"] and set(tables.edp_groups) == want["edp"]
    for rank in range(world):  # each rank in exactly one group of each kind, and its local view agrees
        local = local_folding_ranks(rank, spec)
        for kind, groups in zip(("tp", "dense_dp", "ep", "edp"), tables.__dict__.values(), strict=True):
            assert sum(rank in g for g in groups) == 1
            assert rank in local[kind]


def test_tables_keep_deepspeeds_order() -> None:
    tables = expected_folding_group_tables(build_folding_spec(world_size=8, pp_size=1, tp_size=2, ep_size=4))
    assert tables.dense_dp_groups == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert tables.edp_groups == ((0, 4), (1, 5), (2, 6), (3, 7))


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        (dict(world_size=7, pp_size=2, tp_size=1, ep_size=1), r"pp_size=2 must divide world_size=7.*\[1, 7\]"),
        (dict(world_size=8, pp_size=1, tp_size=3, ep_size=1), r"tensor_parallel.autotp_size=3.*\[1, 2, 4, 8\]"),
        (dict(world_size=8, pp_size=1, tp_size=2, ep_size=3), r"autoep_size \* .*expert_tensor_parallel_size \(3"),
        (dict(world_size=8, pp_size=1, tp_size=0, ep_size=1), r"autotp_size must be a positive integer, got 0"),
        (dict(world_size=8, pp_size=1, tp_size=1, ep_size=True), r"autoep_size must be a positive integer"),
    ],
)
def test_sizes_that_do_not_tile_a_stage_are_refused(sizes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_folding_spec(**sizes)


_FOLDED = build_folding_spec(world_size=4, pp_size=1, tp_size=2, ep_size=2)


@pytest.mark.parametrize(
    ("spec", "kwargs", "message"),
    [
        (_FOLDED, dict(deepcompile_enabled=True), "DeepCompile"),
        (build_folding_spec(world_size=8, pp_size=2, tp_size=2, ep_size=2), {}, "pp_size=1 only"),
        (_FOLDED, dict(sp_size=2), "mutually exclusive"),
        (build_folding_spec(world_size=8, pp_size=1, tp_size=2, ep_size=2, etp_size=2), {}, "reserved"),
        (_FOLDED, dict(tp_preset="mixtral", ep_preset="qwen3_moe"), "must match"),
        (build_folding_spec(world_size=4, pp_size=1, tp_size=2, ep_size=1), {}, "autoep_size > 1"),
        (_FOLDED, dict(use_data_before_expert_parallel=True), "use_data_before_expert_parallel_"),
        (_FOLDED, dict(zero_offload_param=True), "offload"),
        (_FOLDED, dict(zero_stage=3), r"ZeRO stage 3 \(zero_optimization.stage=3\).* separate ZeRO-3 composition lane"),
        (_FOLDED, dict(mpu=SimpleNamespace(get_model_parallel_world_size=lambda: 4)), r"mpu tensor/model .* \(4\)"),
    ],
)
def test_global_rules_refuse_what_folding_does_not_support(spec, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_folding_global(spec, **kwargs)


def test_global_rules_leave_unfolded_layouts_and_disabled_autoep_alone() -> None:
    unfolded = build_folding_spec(world_size=8, pp_size=2, tp_size=1, ep_size=2)
    validate_folding_global(unfolded, deepcompile_enabled=True, sp_size=2, zero_offload_optimizer=True, zero_stage=3)
    for stage in (0, 1, 2):
        validate_folding_global(_FOLDED, zero_stage=stage)
    validate_folding_global(_FOLDED, deepcompile_enabled=True, autoep_enabled=False)


def test_a_registry_built_for_another_layout_is_refused() -> None:
    spec = build_folding_spec(world_size=8, pp_size=1, tp_size=2, ep_size=4)
    assert_group_matches_spec(([(0, 1, 2, 3)], [(1, 5)]), spec)
    assert_group_matches_spec({"ep": [[4, 5, 6, 7]], "edp": []}, spec)
    with pytest.raises(RuntimeError, match=r"expert-parallel group \(0, 2, 4, 6\) does not match"):
        assert_group_matches_spec(([(0, 2, 4, 6)], []), spec)
    with pytest.raises(RuntimeError, match=r"expert-data-parallel group \(0, 1\)"):
        assert_group_matches_spec(([], [(0, 1)]), spec)


def test_handles_carry_the_callers_groups() -> None:
    local = local_folding_ranks(3, _FOLDED)
    groups = [object() for _ in range(4)]
    handles = FoldingGroupHandles(
        _FOLDED, *groups, "ep_size_2", local["tp"], local["dense_dp"], local["ep"], local["edp"]
    )
    assert handles.ep_group is groups[2] and handles.edp_ranks == (1, 3) and handles.tp_ranks == (2, 3)
    with pytest.raises(ValueError, match="global_rank=4 is outside world_size=4"):
        local_folding_ranks(4, _FOLDED)


def test_fused_layout_is_read_from_the_shapes() -> None:
    gate_up_first = classify_fused_gate_up_layout((4, 2 * 12, 16), (4, 16, 12))
    hidden_first = classify_fused_gate_up_layout(torch.Size([4, 16, 24]), (4, 12, 16))
    assert gate_up_first is not None and hidden_first is not None
    assert (gate_up_first.layout, gate_up_first.needs_transpose) == ("gate_up_first", False)
    assert (hidden_first.layout, hidden_first.needs_transpose) == ("hidden_first", True)
    assert (hidden_first.hidden_size, hidden_first.ffn_hidden_size) == (16, 12)
    for w1, w2 in [
        ((4, 16, 16), (4, 16, 16)),
        ((4, 25, 16), (4, 16, 12)),
        ((16, 24), (16, 12)),
        ((4, 24, 16), (4, 16, 11)),
    ]:
        assert classify_fused_gate_up_layout(w1, w2) is None
