"""`"sequence_parallel_size": 2` with no mpu: initialize() builds ds-parallel's mesh, reduces gradients over
the SP peers and counts batches per replica; an mpu alone (the key unset) sets the degree the same way, as
in DeepSpeed; a config that disagrees with the mpu is refused by name.

Needs ds-parallel (the `ds-engine[all]` session); skipped without it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from ds_comm.testing import run_ranks

pytest.importorskip("ds_parallel", reason="sequence parallelism needs ds-parallel: pip install 'ds-engine[parallel]'")

CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_clipping": 0.0,
    "sequence_parallel_size": 2,
    "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
}


def _inputs(rank: int) -> torch.Tensor:
    return torch.arange(4, dtype=torch.float32).view(1, 4) + rank


def _train(rank: int, world: int, with_mpu: bool = False) -> dict[str, Any]:
    import ds_engine as deepspeed
    from ds_parallel import MeshMPU, groups

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    if with_mpu:  # the mpu alone sets the degree: the config leaves the key unset, as DeepSpeed's users do
        mpu = MeshMPU(groups.initialize_mesh(sp=2))
        config = {k: v for k, v in CONFIG.items() if k != "sequence_parallel_size"}
        engine, *_ = deepspeed.initialize(model=model, config=config, mpu=mpu)
    else:
        engine, *_ = deepspeed.initialize(model=model, config=CONFIG)
    loss = engine(_inputs(rank)).pow(2).mean()  # SP peers see different tokens of one sample
    engine.backward(loss)
    engine.step()
    return {
        "weight": engine.module.weight.detach().clone(),
        "train_batch_size": engine.train_batch_size(),
        "sp": groups._get_sequence_parallel_world_size(),
    }


@pytest.mark.parametrize("with_mpu", [False, True], ids=["config", "mpu-only"])
def test_config_alone_builds_the_mesh_and_reduces_over_sequence_peers(with_mpu: bool) -> None:
    res = run_ranks(2, _train, with_mpu, timeout_s=120)
    torch.manual_seed(0)
    ref = nn.Linear(4, 1)
    loss = sum(ref(_inputs(r)).pow(2).mean() for r in range(2)) / 2  # the engine averages over data x sequence
    loss.backward()
    with torch.no_grad():
        expected = ref.weight - 0.1 * ref.weight.grad
    for r in res:
        assert r["sp"] == 2 and r["train_batch_size"] == 1
        torch.testing.assert_close(r["weight"], expected, atol=1e-6, rtol=1e-6)


def _mismatch(rank: int, world: int) -> str:
    import ds_engine as deepspeed
    from ds_parallel import MeshMPU, groups

    mpu = MeshMPU(groups.initialize_mesh(sp=2))
    try:
        deepspeed.initialize(model=nn.Linear(4, 1), config={**CONFIG, "sequence_parallel_size": 1}, mpu=mpu)
    except ValueError as err:
        return str(err)
    return "no error"


def test_config_disagreeing_with_the_mpu_is_refused() -> None:
    msg = run_ranks(2, _mismatch, timeout_s=120)[0]
    assert "sequence_parallel_size=1 in the config but the mpu's sequence-parallel world size is 2" in msg


def _module_mpu_checkpoint(rank: int, world: int, ckpt_dir: str) -> dict[str, Any]:
    import ds_engine as deepspeed
    from ds_engine.runtime.sequence_parallel import parallel_state_sp as sp_mpu

    config = {"train_batch_size": world, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    config["zero_optimization"] = {"stage": 1}
    source = nn.Linear(4, 4)
    with torch.no_grad():
        for p in source.parameters():
            p.fill_(1.5)
    engine, *_ = deepspeed.initialize(model=source, model_parameters=source.parameters(), config=config)
    engine.save_checkpoint(ckpt_dir, tag="no_sp")
    sp_mpu.initialize_sequence_parallel(world)  # the module itself is the mpu, the config has no SP key
    target = nn.Linear(4, 4)
    engine, *_ = deepspeed.initialize(model=target, model_parameters=target.parameters(), config=config, mpu=sp_mpu)
    engine.load_checkpoint(ckpt_dir, tag="no_sp", load_module_only=True, load_optimizer_states=False)
    return {
        "sp": engine.sequence_parallel_size,
        "mp_world_size": engine.mp_world_size,
        "checkpoint_mp_rank": engine.checkpoint_mp_rank,
        "module_model_parallel_rank": sp_mpu.get_model_parallel_rank(),
        "loaded": all(torch.equal(v, torch.full_like(v, 1.5)) for v in engine.module.state_dict().values()),
    }


def test_module_mpu_counts_no_model_parallelism_and_loads_a_non_sp_checkpoint(tmp_path: Any) -> None:
    """DeepSpeed's ALST module mpu: its get_model_parallel_* are the SP group's, yet the engine counts no
    model parallelism (DeepSpeed's rule for an mpu with `initialize_sequence_parallel`), takes SP 2 from it
    and loads a checkpoint saved without sequence parallelism."""
    res = run_ranks(2, _module_mpu_checkpoint, str(tmp_path), timeout_s=180)
    for rank, r in enumerate(res):
        assert r == {
            "sp": 2,
            "mp_world_size": 1,
            "checkpoint_mp_rank": 0,
            "module_model_parallel_rank": rank,
            "loaded": True,
        }


def _sp_group_sums(rank: int, world: int, sp: int) -> tuple[float, float, bool]:
    import ds_comm
    import ds_engine as deepspeed

    config = {**CONFIG, "sequence_parallel_size": sp}
    engine, *_ = deepspeed.initialize(model=nn.Linear(4, 1), config=config)
    if sp == 1:
        return 0.0, 0.0, hasattr(engine, "seq_parallel_group")
    value = torch.tensor([float(rank + 1)])
    ds_comm.all_reduce(value, group=engine.seq_parallel_group)
    again = torch.tensor([float(rank + 1)])
    ds_comm.all_reduce(again, group=engine.get_sequence_parallel_group())
    return float(value), float(again), True


def test_engine_exposes_the_sequence_parallel_group() -> None:
    """`engine.seq_parallel_group` / `get_sequence_parallel_group()` (DeepSpeed's names, used by scripts that
    reduce a loss over the sequence peers): at 4 ranks with SP=2 the groups are {0, 1} and {2, 3}; with SP=1
    the attribute does not exist, as in DeepSpeed."""
    sums = run_ranks(4, _sp_group_sums, 2, timeout_s=180)
    assert [s[:2] for s in sums] == [(3.0, 3.0), (3.0, 3.0), (7.0, 7.0), (7.0, 7.0)]
    assert [s[2] for s in run_ranks(2, _sp_group_sums, 1, timeout_s=120)] == [False, False]
