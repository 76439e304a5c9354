"""`deepspeed.checkpoint.DeepSpeedCheckpoint` on a checkpoint the engine saved and on DeepSpeed's pipeline layout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from ds_engine_testkit import base_config, batches, loss_fn, make_engine, tiny_net

from ds_engine.checkpoint import DeepSpeedCheckpoint, constants
from ds_engine.checkpoint.utils import get_model_ckpt_name_for_rank, get_zero_ckpt_name_for_rank


def _save(path: Path, state: Any) -> None:
    torch.save(state, path)


def _pipeline_folder(folder: Path, dims: list[dict[str, int] | None], dp: int = 2, layers: int = 3) -> None:
    """A DeepSpeed-shaped pipeline tag directory: mp_rank files, bf16 ZeRO files per dp rank, layer files."""
    for mp, recorded in enumerate(dims):
        state: dict[str, Any] = {"module": None, "global_steps": 7, "iteration": 70, "args": {"lr": 0.1}}
        if recorded is not None:
            state[constants.CHECKPOINT_PARALLEL_DIMS] = recorded
        state[constants.UNIVERSAL_CHECKPOINT_INFO] = {"universal_checkpoint_version": 0.2}
        _save(Path(get_model_ckpt_name_for_rank(str(folder), f"{mp:02d}")), state)
        for dp_rank in range(dp):
            name = f"bf16_zero_pp_rank_{dp_rank}_mp_rank_{mp:02d}_optim_states.pt"
            _save(folder / name, {constants.OPTIMIZER_STATE_DICT: {"rank": (mp, dp_rank)}})
    for layer in range(layers):
        _save(folder / f"layer_{layer:02d}-model_states.pt", {"weight": torch.full((2,), float(layer))})


def test_a_checkpoint_the_engine_saved(tmp_path: Path) -> None:
    pytest.importorskip("ds_zero")
    model = tiny_net(0)
    engine = make_engine(model, base_config(zero_optimization={"stage": 1}))
    for x, y in batches(2, 4):
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    engine.save_checkpoint(str(tmp_path))
    ckpt = DeepSpeedCheckpoint(tmp_path / "global_step2")
    assert ckpt.mp_rank_files == [str(tmp_path / "global_step2" / "mp_rank_00_model_states.pt")]
    assert ckpt.zero_files == [get_zero_ckpt_name_for_rank(str(tmp_path / "global_step2"), 0, 0)]
    assert (ckpt.pp_degree, ckpt.tp_degree, ckpt.dp_degree) == (1, 1, 1)
    assert ckpt.get_iteration() == 2 and ckpt.get_args() is None
    saved = ckpt.get_model_state()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(saved["module"][name], value, rtol=0, atol=0)
    assert saved[constants.BUFFER_NAMES] == ["buf"] and constants.PARAM_SHAPES in saved
    assert constants.OPTIMIZER_STATE_DICT in ckpt.get_zero_checkpoint_state(0, 0, 0)


def test_deepspeed_pipeline_layout(tmp_path: Path) -> None:
    dims = {constants.CHECKPOINT_PP_DEGREE: 2, constants.CHECKPOINT_TP_DEGREE: 1}
    _pipeline_folder(tmp_path, [dims, dims])
    ckpt = DeepSpeedCheckpoint(str(tmp_path), pp_degree=2)
    assert (ckpt.pp_degree, ckpt.tp_degree, ckpt.dp_degree) == (2, 1, 2)
    assert (ckpt.original_pp_degree, ckpt.original_dp_degree) == (2, 2)
    assert [Path(f).name[:30] for f in ckpt.zero_files] == [
        "bf16_zero_pp_rank_0_mp_rank_00",
        "bf16_zero_pp_rank_1_mp_rank_00",
        "bf16_zero_pp_rank_0_mp_rank_01",
        "bf16_zero_pp_rank_1_mp_rank_01",
    ]
    assert ckpt.get_zero_checkpoint_state(1, 0, 1)[constants.OPTIMIZER_STATE_DICT] == {"rank": (1, 1)}
    assert len(ckpt.layer_files) == 3
    torch.testing.assert_close(ckpt.get_layer_state(2)["weight"], torch.full((2,), 2.0))
    assert ckpt.get_iteration() == 70 and ckpt.get_args() == {"lr": 0.1}
    assert ckpt.get_checkpoint_info(constants.UNIVERSAL_CHECKPOINT_INFO) == {"universal_checkpoint_version": 0.2}
    assert ckpt.get_checkpoint_info() is None  # Megatron's checkpoint_info, by default as in DeepSpeed
    assert [path for path, _ in ckpt.model_state_metadata] == ckpt.mp_rank_files
    assert ckpt.model_state_metadata[1][1][constants.CHECKPOINT_PARALLEL_DIMS] == dims
    assert ckpt.get_model_state(pp_index=1)["global_steps"] == 7


def test_legacy_files_without_parallel_dimensions(tmp_path: Path) -> None:
    _pipeline_folder(tmp_path, [None, None], dp=1)
    ckpt = DeepSpeedCheckpoint(tmp_path)
    assert (ckpt.pp_degree, ckpt.tp_degree, ckpt.dp_degree) == (2, 1, 1)


@pytest.mark.parametrize(
    ("dims", "message"),
    [
        ([{"pp_degree": 2, "tp_degree": 1}, None], "missing from model-state files"),
        ([{"pp_degree": 2, "tp_degree": 1}, {"pp_degree": 1, "tp_degree": 2}], "disagrees across model-state files"),
        ([{"pp_degree": 4, "tp_degree": 1}] * 2, r"count 2 does not match pp_degree=4 \* tp_degree=1"),
    ],
)
def test_inconsistent_layouts_are_named(tmp_path: Path, dims: list[dict[str, int] | None], message: str) -> None:
    _pipeline_folder(tmp_path, dims)
    with pytest.raises(ValueError, match=message):
        DeepSpeedCheckpoint(tmp_path)


def test_refusals(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not a directory"):
        DeepSpeedCheckpoint(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no mp_rank_XX_model_states.pt"):
        DeepSpeedCheckpoint(tmp_path)
    _pipeline_folder(tmp_path, [None, None])
    with pytest.raises(NotImplementedError, match="ds_to_universal"):
        DeepSpeedCheckpoint(tmp_path, dp_degree=4)
    ckpt = DeepSpeedCheckpoint(tmp_path)
    with pytest.raises(IndexError, match="pp_index 2"):
        ckpt.get_model_state(pp_index=2)
    with pytest.raises(IndexError, match="no layer file for layer 9"):
        ckpt.get_layer_state(9)


def test_file_names() -> None:
    assert get_model_ckpt_name_for_rank("ck", "03") == str(Path("ck") / "mp_rank_03_model_states.pt")
    assert get_zero_ckpt_name_for_rank("ck", 5, 1) == str(Path("ck") / "zero_pp_rank_5_mp_rank_01_optim_states.pt")
    assert constants.BF16_ZERO_FILE_PREFIX + "0_mp_rank_00" + constants.OPTIM_FILE_SUFFIX == (
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    )
