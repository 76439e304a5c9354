"""`get_model_3d_descriptor`, `ZeROCheckpoint`, the model-states summary and the parallel-dimensions metadata.

Tag directories are written here in DeepSpeed's layout (`mp_rank_XX_model_states.pt`,
`[bf16_]zero_pp_rank_{dp}_mp_rank_{mp}_optim_states.pt`, `layer_XX-model_YY-model_states.pt`).
Merged optimizer states are compared with the flat tensors they were cut from (plain torch.cat/narrow).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest.mock import ANY

import pytest
import torch

import ds_comm
from ds_engine.checkpoint import (
    CheckpointLayoutError,
    DeepSpeedCheckpoint,
    ZeROCheckpoint,
    constants,
    get_model_3d_descriptor,
    merge_state,
    model_3d_desc,
)
from ds_engine.checkpoint.model_state_metadata import (
    aggregate_autoep_zero12_metadata as _aggregate_autoep_zero12_metadata,
)
from ds_engine.runtime.engine import _checkpoint_parallel_metadata


def _dims(pp: int, tp: int) -> dict[str, int]:
    return {constants.CHECKPOINT_PP_DEGREE: pp, constants.CHECKPOINT_TP_DEGREE: tp}


def _folder(
    root: Path, num_mp: int, dp: int, dims: dict[str, int] | None, prefix: str = "", **extra: Any
) -> list[Path]:
    """num_mp model-states files (recording `dims`), dp empty ZeRO files each; the model-states paths."""
    paths = []
    for mp in range(num_mp):
        state: dict[str, Any] = {"module": {"w": torch.full((2,), float(mp))}, "param_shapes": [{"w": (2,)}], **extra}
        if dims is not None:
            state[constants.CHECKPOINT_PARALLEL_DIMS] = dims
        paths.append(root / f"mp_rank_{mp:02d}_model_states.pt")
        torch.save(state, paths[-1])
        for d in range(dp):
            torch.save({}, root / f"{prefix}zero_pp_rank_{d}_mp_rank_{mp:02d}_optim_states.pt")
    return paths


def _layout(desc: model_3d_desc) -> tuple[int, int, int]:
    return desc.pp_degree, desc.tp_degree, desc.dp_degree


def test_recorded_dimensions_win_over_file_counts(tmp_path: Path) -> None:
    """Six model-states files recording pp 3 x tp 2 with 4 ZeRO files each: dp 4 (24 files / 6)."""
    _folder(tmp_path, 6, 4, _dims(3, 2), prefix="bf16_")
    assert _layout(get_model_3d_descriptor(tmp_path)) == (3, 2, 4)
    assert _layout(get_model_3d_descriptor(str(tmp_path))) == (3, 2, 4)


def test_legacy_rules(tmp_path: Path) -> None:
    """No recorded dimensions: tp from one pipeline layer's files, else every mp_rank file is a tp slice."""
    _folder(tmp_path, 4, 3, None)
    assert _layout(get_model_3d_descriptor(tmp_path)) == (1, 4, 3)
    for layer in range(3):
        for tp in range(2):
            torch.save({}, tmp_path / f"layer_{layer:02d}-model_{tp:02d}-model_states.pt")
    assert _layout(get_model_3d_descriptor(tmp_path)) == (2, 2, 3)


def test_no_zero_files_is_dp_1(tmp_path: Path) -> None:
    _folder(tmp_path, 2, 0, _dims(2, 1))
    assert _layout(get_model_3d_descriptor(tmp_path)) == (2, 1, 1)
    with pytest.raises(FileNotFoundError, match="no ZeRO optimizer-state files"):
        ZeROCheckpoint(tmp_path)


@pytest.mark.parametrize(
    ("num_mp", "dp", "dims", "message"),
    [
        (2, 1, _dims(2, 2), r"model-state file count 2 does not match pp_degree=2 \* tp_degree=2"),
        (2, 1, {"pp_degree": 2}, "tp_degree must be a positive integer in .*mp_rank_00_model_states.pt, got None"),
        (2, 1, {"pp_degree": True, "tp_degree": 1}, "pp_degree must be a positive integer"),
        (1, 1, [2, 1], "checkpoint_parallel_dimensions must be a dictionary"),
    ],
)
def test_bad_recorded_dimensions(tmp_path: Path, num_mp: int, dp: int, dims: Any, message: str) -> None:
    _folder(tmp_path, num_mp, dp, dims)
    with pytest.raises(CheckpointLayoutError, match=message):
        get_model_3d_descriptor(tmp_path)


def test_missing_and_disagreeing_dimensions_name_the_files(tmp_path: Path) -> None:
    paths = _folder(tmp_path, 2, 1, _dims(1, 2))
    torch.save({"module": None}, paths[1])
    with pytest.raises(RuntimeError, match="missing from model-state files.*mp_rank_01_model_states.pt"):
        get_model_3d_descriptor(tmp_path)
    torch.save({constants.CHECKPOINT_PARALLEL_DIMS: _dims(2, 1)}, paths[1])
    with pytest.raises(ValueError, match=r"disagrees across model-state files: \[\(1, 2\), \(2, 1\)\]"):
        get_model_3d_descriptor(tmp_path)


def test_uneven_zero_files_are_refused(tmp_path: Path) -> None:
    _folder(tmp_path, 2, 1, _dims(1, 2))
    torch.save({}, tmp_path / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(
        CheckpointLayoutError, match="ZeRO file count 3 is not divisible by pp_degree=1 \\* tp_degree=2"
    ):
        get_model_3d_descriptor(tmp_path)


def _zero_state(flat: torch.Tensor, padding: int, group_count: int = 1) -> dict[str, Any]:
    """An optimizer-states file whose group 0 holds `flat` (padded by `padding` zeros) as exp_avg."""
    padded = torch.cat([flat, torch.zeros(padding)])
    return {
        constants.OPTIMIZER_STATE_DICT: {
            constants.BASE_OPTIMIZER_STATE: {"state": {0: {"exp_avg": padded, "step": torch.tensor(5.0)}}},
            constants.GROUP_PADDINGS: [padding] * group_count,
            constants.PARTITION_COUNT: [2] * group_count,
            "loss_scale": 1.0,
        },
        constants.PARAM_SHAPES: [{"w": (10,)}],
    }


def test_zero_states_merge_back_into_the_flat_tensor(tmp_path: Path) -> None:
    """pp 1 x tp 1 x dp 2 -> dp 1: exp_avg of 10 elements was cut 6 + 4 (+2 padding); merged it is the original."""
    flat = torch.randn(10, generator=torch.Generator().manual_seed(3))
    _folder(tmp_path, 1, 0, _dims(1, 1))
    torch.save(_zero_state(flat[:6], 0), tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    torch.save(_zero_state(flat[6:], 2), tmp_path / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    zero = ZeROCheckpoint(tmp_path)
    assert (zero.get_src_pp_degree(), zero.get_src_tp_degree(), zero.get_src_dp_degree()) == (1, 1, 2)
    assert zero.get_src_world_size() == 2 and zero.num_files == 2
    assert zero.get_files_for_rank(0, 0, 1) == [str(tmp_path / "zero_pp_rank_1_mp_rank_00_optim_states.pt")]
    own = zero.get_state_for_rank(0, 0, 1)
    assert own is not None
    torch.testing.assert_close(
        own[constants.OPTIMIZER_STATE_DICT]["base_optimizer_state"]["state"][0]["exp_avg"], flat[6:]
    )

    zero.reshape(model_3d_desc(1, 1, 1))
    assert zero.get_file_indices_for_rank(0, 0, 0) == [0, 1]
    merged = zero.get_state_for_rank(0, 0, 0, keys_to_ignore=[constants.PARAM_SHAPES])
    assert merged is not None and constants.PARAM_SHAPES not in merged
    opt = merged[constants.OPTIMIZER_STATE_DICT]
    torch.testing.assert_close(opt["base_optimizer_state"]["state"][0]["exp_avg"], flat, rtol=0, atol=0)
    assert opt[constants.PARTITION_COUNT] == [1] and opt[constants.GROUP_PADDINGS] == [0]
    assert opt["base_optimizer_state"]["state"][0]["step"] == torch.tensor(5.0)  # a 0-d counter is kept, not stacked
    assert opt["loss_scale"] == 1.0
    # Without stripping, the padding stays where rank 1's partition ended.
    raw = zero.get_state_for_rank(0, 0, 0, strip_tensor_paddings=False)
    assert raw is not None
    assert raw[constants.OPTIMIZER_STATE_DICT]["base_optimizer_state"]["state"][0]["exp_avg"].numel() == 12
    with pytest.raises(IndexError, match="dp_index 1 outside the target dp degree 1"):
        zero.get_files_for_rank(0, 0, 1)
    with pytest.raises(ValueError, match="Expansion reshape not supported - DP: 2 ---> 4"):
        zero.reshape(model_3d_desc(1, 1, 4))


def test_deepspeed_checkpoint_loads_each_model_file_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _folder(tmp_path, 4, 2, _dims(2, 2), iteration=40, args={"seed": 1}, checkpoint_info={"padded_vocab_size": 8})
    loaded: list[str] = []
    original = ds_comm.load_checkpoint_file

    def counting(path: Any, **kwargs: Any) -> Any:
        loaded.append(str(path))
        return original(path, **kwargs)

    monkeypatch.setattr(ds_comm, "load_checkpoint_file", counting)
    ckpt = DeepSpeedCheckpoint(tmp_path)
    assert (ckpt.pp_degree, ckpt.tp_degree, ckpt.dp_degree) == (2, 2, 2)
    assert ckpt.get_iteration() == 40 and ckpt.get_args() == {"seed": 1}
    assert ckpt.get_checkpoint_info() == {"padded_vocab_size": 8}
    assert loaded == ckpt.mp_rank_files
    summary = dict(ckpt.model_state_metadata)[ckpt.mp_rank_files[3]]
    assert summary == {
        constants.CHECKPOINT_PARALLEL_DIMS: _dims(2, 2),
        constants.PARAM_SHAPES: {"w": (2,)},
        constants.AUTOEP_LAYERS_KEY: None,
        "ds_config": {"use_data_before_expert_parallelism": False},
    }
    # Other keys and whole states are read on request.
    assert ckpt.get_checkpoint_info("missing_key") is None and len(loaded) == 5
    torch.testing.assert_close(ckpt.get_model_state(1, 1)["module"]["w"], torch.full((2,), 3.0))


def _summary(shapes: Any = None, autoep: Any = None, ordering: Any = False) -> dict[str, Any]:
    return {
        constants.PARAM_SHAPES: {"w": (4,)} if shapes is None else shapes,
        constants.AUTOEP_LAYERS_KEY: autoep,
        "ds_config": {"use_data_before_expert_parallelism": ordering},
    }


def _layer(prefix: str, experts: int = 4) -> dict[str, Any]:
    return {"expert_key_prefix": prefix, "num_experts": experts, "num_local_experts": 2, "ep_size": 2}


def test_autoep_aggregation() -> None:
    files = [("a", _summary(autoep=[_layer("m.0.")])), ("b", _summary(autoep=[_layer("m.0."), _layer("m.1.")]))]
    shapes, layers, ordering = _aggregate_autoep_zero12_metadata(files)
    assert shapes == [{"w": (4,)}, {"w": (4,)}] and ordering is False
    assert layers == [_layer("m.0."), _layer("m.1.")]
    assert _aggregate_autoep_zero12_metadata([("a", _summary(ordering=True))]) == ([{"w": (4,)}], None, True)


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ([("a", _summary(shapes="list"))], "param_shapes must contain dictionaries in a"),
        ([("a", _summary(autoep="str"))], "AutoEP metadata must be a list in a"),
        ([("a", _summary(autoep=["str"]))], "AutoEP layer metadata must contain dictionaries in a"),
        ([("a", _summary(autoep=[{"num_experts": 2}]))], "expert_key_prefix must be a non-empty string in a"),
        (
            [("a", _summary(autoep=[_layer("m.")])), ("b", _summary(autoep=[_layer("m.", 8)]))],
            "Conflicting AutoEP metadata for expert_key_prefix 'm.' in a and b",
        ),
        ([("a", _summary(ordering="int"))], "use_data_before_expert_parallelism must be a boolean in a"),
        ([("a", _summary()), ("b", _summary(ordering=True))], "disagrees across model-state files"),
    ],
)
def test_autoep_aggregation_refusals(files: list[tuple[str, dict[str, Any]]], message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        _aggregate_autoep_zero12_metadata(files)


def test_summary_of_malformed_autoep_and_config(tmp_path: Path) -> None:
    """The legacy AutoEP key is read too; wrong types are kept as their names for the consumer to report."""
    _folder(tmp_path, 1, 0, None, autoep_layers=[{**_layer("e."), "extra": 1}, 3], ds_config={"x": 1})
    ((_, summary),) = DeepSpeedCheckpoint(tmp_path).model_state_metadata
    assert summary[constants.AUTOEP_LAYERS_KEY] == [_layer("e."), "int"]
    torch.save({"param_shapes": {"w": 1}, "ds_config": "cfg"}, tmp_path / "mp_rank_00_model_states.pt")
    ((_, summary),) = DeepSpeedCheckpoint(tmp_path).model_state_metadata
    assert summary[constants.PARAM_SHAPES] == "dict" and summary["ds_config"] == "str"


@pytest.mark.parametrize(
    ("mpu", "expected"),
    [
        (None, (1, 1)),
        (SimpleNamespace(get_pipe_parallel_world_size=lambda: 4, get_slice_parallel_world_size=lambda: 2), (4, 2)),
        (
            SimpleNamespace(
                get_pipeline_model_parallel_world_size=lambda: 2,
                get_pipe_parallel_world_size=lambda: 99,
                get_tensor_model_parallel_world_size=lambda: 8,
                get_slice_parallel_world_size=lambda: 99,
            ),
            (2, 8),
        ),
        (SimpleNamespace(get_model_parallel_world_size=lambda: 4), (1, 4)),
    ],
)
def test_checkpoint_parallel_metadata_of_an_mpu(mpu: Any, expected: tuple[int, int]) -> None:
    assert _checkpoint_parallel_metadata(mpu) == {constants.CHECKPOINT_PARALLEL_DIMS: _dims(*expected)}


def test_merge_state_refusals() -> None:
    merged = merge_state({"a": [torch.ones(1)], "b": 1}, {"a": [torch.zeros(2)], "c": 2})
    assert merged == {"a": [ANY], "b": 1, "c": 2}
    torch.testing.assert_close(merged["a"][0], torch.tensor([1.0, 0.0, 0.0]))
    with pytest.raises(ValueError, match="cannot merge a Tensor with a float at a.0"):
        merge_state({"a": [torch.ones(1)]}, {"a": [1.0]})
    with pytest.raises(ValueError, match="cannot merge lists of lengths 1 and 2 at a"):
        merge_state({"a": [1]}, {"a": [1, 2]})


def test_ds_to_universal_serves_the_aggregation_under_deepspeeds_name() -> None:
    pytest.importorskip("ds_zero", reason="deepspeed.checkpoint.ds_to_universal needs the zero extra")
    from ds_engine.checkpoint import ds_to_universal

    assert ds_to_universal._aggregate_autoep_zero12_metadata is _aggregate_autoep_zero12_metadata
