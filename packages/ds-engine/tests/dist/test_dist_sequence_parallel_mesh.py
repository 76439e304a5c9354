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
