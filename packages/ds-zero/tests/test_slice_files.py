"""DeepSpeed's file-level conversion steps (`ds_zero.ds_to_universal`): fragment files of a model cut over
tensor-parallel ranks and partitioned over data-parallel ranks go back to the whole tensors they came from,
fused projections section by section (uneven grouped-query widths, legacy section counts), missing empty
ranks realigned, and pipeline-stage shape files grouped per tensor-parallel rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ds_zero.ds_to_universal import UniversalMergeError, group_per_tp_shapes, merge_tp_slices, merge_zero_shards

STATES = {"fp32": 1.0, "exp_avg": -2.0, "exp_avg_sq": 3.0}


def _dump(root: Path, name: str, shards: list[torch.Tensor], dp: int, step: int | None = 7) -> None:
    """Write each rank's shard as DeepSpeed's extraction does: `dp` flat pieces per state (and the step)."""
    for tp, shard in enumerate(shards):
        if shard.numel() == 0:
            continue  # a rank owning none of the parameter writes nothing
        folder = root / name / str(tp)
        folder.mkdir(parents=True)
        for state, scale in STATES.items():
            for d, piece in enumerate((shard.reshape(-1) * scale).tensor_split(dp)):
                torch.save(piece.clone(), folder / f"{state}.{d:02d}")
        if step is not None:
            for d in range(dp):
                torch.save(step, folder / f"step.{d:02d}")


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=False)


def test_fused_qkv_with_uneven_head_widths_is_rebuilt_per_section(tmp_path: Path) -> None:
    # q: 4 heads, k/v: 2 heads each, head_dim 3, over 3 ranks as heads [2,1,1] / [1,1,0] / [1,1,0]
    head, hidden = 3, 5
    whole = torch.randn(8 * head, hidden)
    widths = [[2 * head, head, head], [head, head, 0], [head, head, 0]]
    q, k, v = whole.split([4 * head, 2 * head, 2 * head])
    shards = []
    for rank in range(3):
        parts = [sec.narrow(0, sum(w[:rank]), w[rank]) for sec, w in zip((q, k, v), widths, strict=True)]
        shards.append(torch.cat(parts))
    _dump(tmp_path / "tmp", "qkv.weight", shards, dp=2)
    info = {
        "universal_checkpoint_version": 0.4,
        "parameter_with_sub_params": [
            {"patterns": [r"^qkv\.weight$"], "shape": [(4 * head, 2 * head, 2 * head), -1], "partition_dim": 0}
        ],
        "sub_param_shard_widths": {r"^qkv\.weight$": widths},
    }
    unused = merge_tp_slices(info, tmp_path / "zero", tmp_path / "tmp", 3, ("qkv.weight", [s.shape for s in shards]))
    assert unused == set()
    for state, scale in STATES.items():
        saved = _load(tmp_path / "zero" / "qkv.weight" / f"{state}.pt")
        assert torch.equal(saved["param"], whole * scale)
        assert saved["sub_param_shape"] == {
            "patterns": [r"^qkv\.weight$"],
            "shape": ((12, 6, 6), -1),
            "partition_dim": 0,
        }
    assert _load(tmp_path / "zero" / "qkv.weight" / "step.pt") == 7


def test_legacy_section_count_is_decoded_and_uneven_legacy_cuts_refused(tmp_path: Path) -> None:
    whole = torch.randn(12, 4)
    sections = whole.split(4)
    shards = [torch.cat([s.chunk(2)[r] for s in sections]) for r in range(2)]
    _dump(tmp_path / "tmp", "gate.weight", shards, dp=1, step=None)
    info = {"parameter_with_sub_params": [{"patterns": ["^gate"], "shape": [3, -1], "partition_dim": 0}]}
    merge_tp_slices(info, tmp_path / "zero", tmp_path / "tmp", 2, ("gate.weight", [s.shape for s in shards]))
    saved = _load(tmp_path / "zero" / "gate.weight" / "fp32.pt")
    assert torch.equal(saved["param"], whole) and saved["sub_param_shape"]["shape"] == ((4, 4, 4), -1)
    assert not (tmp_path / "zero" / "gate.weight" / "step.pt").exists()
    # version 0.4 without widths, and an old record of sections the group does not divide
    with pytest.raises(UniversalMergeError, match="records no sub_param_shard_widths"):
        merge_tp_slices(
            {
                **info,
                "universal_checkpoint_version": 0.4,
                "parameter_with_sub_params": [{"patterns": ["^gate"], "shape": [(4, 4, 4), -1], "partition_dim": 0}],
            },
            tmp_path / "z2",
            tmp_path / "tmp",
            2,
            ("gate.weight", [s.shape for s in shards]),
        )
    _dump(tmp_path / "odd", "gate.weight", [whole[:6], whole[6:]], dp=1)
    odd = {"parameter_with_sub_params": [{"patterns": ["^gate"], "shape": [(5, 7), 4], "partition_dim": 0}]}
    with pytest.raises(AssertionError, match="not divisible by tp_degree 2"):
        merge_tp_slices(odd, tmp_path / "z3", tmp_path / "odd", 2, ("gate.weight", [(6, 4), (6, 4)]))


def test_row_parallel_and_replicated_parameters_and_unused_patterns(tmp_path: Path) -> None:
    o_proj, norm = torch.randn(4, 6), torch.randn(4)
    _dump(tmp_path / "tmp", "o.weight", list(o_proj.split([4, 2], dim=1)), dp=3)
    _dump(tmp_path / "tmp", "norm.weight", [norm, norm], dp=1)
    info = {"parameter_with_row_parallelism_patterns": [r"^o\."], "tp_replicated_parameter_patterns": [r"^norm"]}
    unused_o = merge_tp_slices(info, tmp_path / "zero", tmp_path / "tmp", 2, ("o.weight", [(4, 4), (4, 2)]))
    unused_n = merge_tp_slices(info, tmp_path / "zero", tmp_path / "tmp", 2, ("norm.weight", [(4,), (4,)]))
    assert unused_o == {"^norm"} and unused_n == {r"^o\."}  # each pattern is used by some parameter
    row = _load(tmp_path / "zero" / "o.weight" / "fp32.pt")
    assert row["cat_dim"] == 1 and torch.equal(row["param"], o_proj)
    assert torch.equal(_load(tmp_path / "zero" / "norm.weight" / "exp_avg.pt")["param"], norm * -2.0)


def test_a_rank_without_fragments_is_realigned_only_when_its_shape_is_empty(tmp_path: Path) -> None:
    whole = torch.randn(6, 2)
    shards = [whole[:3], whole[3:3], whole[3:]]
    _dump(tmp_path, "p", shards, dp=2)
    slices = merge_zero_shards(tmp_path / "p", "fp32", 3, [(3, 2), (0, 2), (3, 2)])
    assert [tuple(s.shape) for s in slices] == [(3, 2), (0, 2), (3, 2)]
    assert torch.equal(torch.cat(slices), whole)
    assert merge_zero_shards(tmp_path / "p", "step", 3) == [7, 7]
    assert merge_zero_shards(tmp_path / "p", "exp_avg_sq", 3)[0].shape == (6,)  # flat without shapes
    with pytest.raises(AssertionError, match="not empty"):
        merge_zero_shards(tmp_path / "p", "fp32", 3, [(3, 2), (1, 2), (3, 2)])


def test_pipeline_stage_files_are_grouped_per_tensor_parallel_rank() -> None:
    files = [  # file pp * tp_degree + tp
        {"embed": (5, 4), "block0": (2, 4)},
        {"embed": (3, 4), "block0": (2, 4)},
        {"embed": (5, 4), "head": (1, 4)},
        {"embed": (3, 4), "head": (1, 4)},
    ]
    grouped = group_per_tp_shapes(files, pp_degree=2, tp_degree=2)
    assert grouped == {"block0": [(2, 4), (2, 4)], "embed": [(5, 4), (3, 4)], "head": [(1, 4), (1, 4)]}
    files[2] = {"embed": (4, 4)}
    with pytest.raises(AssertionError, match="'embed' on tensor-parallel rank 0 disagree on shape"):
        group_per_tp_shapes(files, pp_degree=2, tp_degree=2)
