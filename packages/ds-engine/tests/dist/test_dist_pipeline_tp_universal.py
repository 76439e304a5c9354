"""A pipeline x tensor-parallel checkpoint (2 stages x 2 `model` ranks, ZeRO 1, four gloo ranks) converts to
universal form: the model-states files are numbered stage-major and record each stage's `param_shapes` and
the grid's `tp_degree`, DeepSpeed's `_group_per_tp_shapes` gives every parameter one shape per
tensor-parallel rank, and the converter merges each stage's tensor-parallel ranks by the checkpoint's
`universal_checkpoint_info` (here every parameter declared replicated, as the plain layers are): each
universal `fp32` is exactly the trained weight of its layer file, both ranks' copies checked equal.
Needs ds-zero and ds-pipe."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from ds_comm.testing import run_ranks

pytest.importorskip("ds_zero", reason="universal checkpoints need ds-zero: pip install 'ds-engine[zero]'")
pytest.importorskip("ds_pipe", reason="pipelines need ds-pipe: pip install 'ds-engine[pipe]'")

HIDDEN = 6


def _train_and_save(rank: int, world: int, save_dir: str) -> None:
    import ds_engine
    from ds_pipe import PipelineModule, PipeModelDataParallelTopology

    torch.manual_seed(0)
    layers = [nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, 1)]
    topology = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1)
    model = PipelineModule(layers=layers, topology=topology, loss_fn=lambda out, y: ((out - y) ** 2).mean())
    config = {
        "train_batch_size": 2,
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 1},
    }
    engine, *_ = ds_engine.initialize(model=model, config=config, model_parameters=list(model.parameters()))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(1, HIDDEN, generator=g), torch.randn(1, 1, generator=g)) for _ in range(2)]
    for _ in range(2):
        engine.train_batch(iter(data))
    engine.save_checkpoint(save_dir, tag="t")


def test_pipeline_by_tensor_parallel_checkpoint_converts(tmp_path: Path) -> None:
    import ds_comm
    from ds_engine.checkpoint import ds_to_universal

    run_ranks(4, _train_and_save, str(tmp_path), timeout_s=300)
    tag = tmp_path / "t"
    states = [ds_comm.load_checkpoint_file(tag / f"mp_rank_{r:02d}_model_states.pt") for r in range(4)]
    for state in states:
        assert state["checkpoint_parallel_dimensions"]["tp_degree"] == 2
    shapes = [{k: tuple(v) for group in s["param_shapes"] for k, v in group.items()} for s in states]
    assert shapes[0] == shapes[1] == {"0.weight": (6, 6), "0.bias": (6,)}  # stage 0 on both tp ranks
    assert shapes[2] == shapes[3] == {"2.weight": (6, 6), "2.bias": (6,), "3.weight": (1, 6), "3.bias": (1,)}
    grouped = ds_to_universal._group_per_tp_shapes(shapes, pp_degree=2, tp_degree=2)
    assert grouped == {name: [shape, shape] for s in shapes for name, shape in s.items()}

    info = {"universal_checkpoint_version": 0.4, "tp_replicated_parameter_patterns": [r"^\d+\.(weight|bias)$"]}
    for r, state in enumerate(states):  # a client that records how its parameters are cut
        state["universal_checkpoint_info"] = info
        torch.save(state, tag / f"mp_rank_{r:02d}_model_states.pt")
    args = SimpleNamespace(
        input_folder=str(tag),
        output_folder=str(tmp_path / "universal"),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=False,
    )
    ds_to_universal.main(args)
    for layer in (0, 2, 3):
        weights = ds_comm.load_checkpoint_file(tag / f"layer_{layer:02d}-model_00-model_states.pt")
        for key in ("weight", "bias"):
            stored = ds_comm.load_checkpoint_file(tmp_path / "universal" / "zero" / f"{layer}.{key}" / "fp32.pt")
            assert torch.equal(stored["param"], weights[key].float()), (layer, key)
            assert "cat_dim" not in stored
