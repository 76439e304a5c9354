"""A 2-stage pipeline checkpoint (gloo, 2 ranks) read back offline: layout, files and saved weights.

The engine records `checkpoint_parallel_dimensions` in each stage's `mp_rank_XX_model_states.pt`, so
`get_model_3d_descriptor`, `DeepSpeedCheckpoint` and `ZeROCheckpoint` report pp 2, tp 1, dp 1 from the
files alone. The per-layer weights read back must equal, bit for bit, the weights each stage held
when it saved; the ZeRO-1 optimizer state of each stage maps to its own file, and onto one stage
after a pp 2 -> 1 reshape.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ds_comm.testing import run_ranks

pytest.importorskip("ds_pipe")
pytest.importorskip("ds_zero")


def _engine() -> Any:
    from pipeline_cases import two_stage_engine

    return two_stage_engine()


def _batches(step: int) -> Any:
    from pipeline_cases import batches

    return batches(step)


def _save(rank: int, world: int, root: str) -> dict[str, Any]:
    engine = _engine()
    for step in range(2):
        engine.train_batch(_batches(step))
    engine.save_checkpoint(root, tag="t")
    # PipelineModule names a layer's parameters by its global index: "2.weight" is layer 2's weight.
    return {
        "stage": engine.stage_id,
        "weights": {tuple(k.split(".", 1)): v.detach().clone() for k, v in engine.module.state_dict().items()},
    }


def test_pipeline_checkpoint_layout_is_read_from_the_files(tmp_path: Path) -> None:
    from ds_engine.checkpoint import DeepSpeedCheckpoint, ZeROCheckpoint, get_model_3d_descriptor, model_3d_desc

    results = run_ranks(2, _save, root=str(tmp_path), timeout_s=180)
    tag = tmp_path / "t"
    desc = get_model_3d_descriptor(tag)
    assert (desc.pp_degree, desc.tp_degree, desc.dp_degree) == (2, 1, 1)

    ckpt = DeepSpeedCheckpoint(tag)
    assert (ckpt.pp_degree, ckpt.tp_degree, ckpt.dp_degree) == (2, 1, 1)
    assert ckpt.mp_rank_files == [str(tag / "mp_rank_00_model_states.pt"), str(tag / "mp_rank_01_model_states.pt")]
    assert [s["checkpoint_parallel_dimensions"] for _, s in ckpt.model_state_metadata] == [
        {"pp_degree": 2, "tp_degree": 1}
    ] * 2
    assert ckpt.get_iteration() == 2

    assert [r["stage"] for r in results] == [0, 1]
    held = {key: value for r in results for key, value in r["weights"].items()}
    assert sorted({layer for layer, _ in held}) == ["0", "2", "3"]  # the ReLU (layer 1) has no weights
    for (layer, name), value in held.items():
        torch.testing.assert_close(ckpt.get_layer_state(int(layer))[name], value, rtol=0, atol=0)

    zero = ZeROCheckpoint(tag)
    assert (zero.get_src_pp_degree(), zero.get_src_tp_degree(), zero.get_src_dp_degree()) == (2, 1, 1)
    own = [zero.get_files_for_rank(stage, 0, 0) for stage in range(2)]
    assert own == [ckpt.get_zero_files(stage, 0, 0) for stage in range(2)]
    assert [Path(f[0]).name for f in own] == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_0_mp_rank_01_optim_states.pt",
    ]
    zero.reshape(model_3d_desc(1, 1, 1))
    assert zero.get_files_for_rank(0, 0, 0) == own[0] + own[1]
