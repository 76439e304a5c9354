"""Per-layer checkpoints: saved by 2 pipe x 2 data ranks, reloaded on 4 stages and on 1, same outputs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pipe_models
import torch

from ds_comm.testing import run_ranks
from ds_pipe import PipeDataParallelTopology, PipelineExecutor, PipelineModule

EVAL_BATCHES = 3


def _eval(module: PipelineModule) -> list[torch.Tensor]:
    executor = PipelineExecutor(module, micro_batches=EVAL_BATCHES)
    data = iter([pipe_models.micro_batch(7, 0, k) for k in range(EVAL_BATCHES)])
    return executor.eval_batch(data, compute_loss=False, reduce_output=None)


def _save(rank: int, world_size: int, save_dir: str) -> dict[str, Any]:
    torch.manual_seed(rank)
    module = PipelineModule(
        pipe_models.specs(),
        topology=PipeDataParallelTopology(2, 2),
        loss_fn=pipe_models.loss_fn,
        partition_method="uniform",
    )
    opt = torch.optim.SGD(module.parameters(), lr=0.5)
    executor = PipelineExecutor(module, micro_batches=2, optimizer_step=opt.step)
    replica = module.mpu().get_data_parallel_rank()
    executor.train_batch(iter([pipe_models.micro_batch(0, replica, k) for k in range(2)]))
    written = module.save_state_dict(save_dir, parallel_write=True)
    return {"written": sorted(p.name for p in written), "logits": _eval(module)}


def _load(rank: int, world_size: int, load_dir: str) -> list[torch.Tensor]:
    torch.manual_seed(1000 + rank)  # a different initialisation, overwritten by the load
    module = PipelineModule(
        pipe_models.specs(), num_stages=world_size, loss_fn=pipe_models.loss_fn, partition_method="parameters"
    )
    module.load_state_dir(load_dir)
    return _eval(module)


def test_layer_files_reload_with_a_different_stage_count(tmp_path: Path) -> None:
    saved = run_ranks(4, _save, save_dir=str(tmp_path), timeout_s=120)
    names = sorted(n for r in saved for n in r["written"])
    assert names == [f"layer_{i:02d}-model_states.pt" for i in range(11) if i != 5]  # layer 5 is a function
    assert saved[0]["written"] and saved[1]["written"], "parallel_write spreads files over both data ranks"
    tied_first = torch.load(tmp_path / "layer_01-model_states.pt", weights_only=True)
    tied_last = torch.load(tmp_path / "layer_09-model_states.pt", weights_only=True)
    assert list(tied_first) == ["weight"] and torch.equal(tied_first["weight"], tied_last["weight"])
    reference = saved[0]["logits"]
    assert len(reference) == EVAL_BATCHES and reference[0].shape == (pipe_models.ROWS, pipe_models.CLASSES)
    for logits in run_ranks(4, _load, load_dir=str(tmp_path), timeout_s=120):
        assert all(torch.equal(a, b) for a, b in zip(logits, reference, strict=True))
    single = PipelineModule(pipe_models.specs(), num_stages=1, loss_fn=pipe_models.loss_fn)
    single.load_state_dir(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(_eval(single), reference, strict=True))
