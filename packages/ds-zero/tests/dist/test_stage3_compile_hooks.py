"""`torch.compile` of a ZeRO-3 model under the eager gather/release hooks (2 gloo ranks): the hooks' coordinator
calls are never traced, and training is the same as uncompiled.

Traced, dynamo guarded on each module's label inside the coordinator and recompiled `pre_forward`,
`post_forward` and `LiveParams.gather` until its recompile limit (3, 4 and 8 cached compilations after 3
steps of the test model); with the calls behind `torch.compiler.disable` (as DeepSpeed's hooks are) none is
compiled, and the model's own code is the only thing in the graphs.
"""

from __future__ import annotations

from typing import Any

import torch
from stage3_cases import STAGE3_CFG, make_model, train_steps

import ds_zero
from ds_comm.testing import run_ranks

STEPS = 3


def _train(rank: int, world: int, compiled: bool) -> dict[str, Any]:
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from ds_zero._schedule.coordinator import ParamCoordinator
    from ds_zero._schedule.live import LiveParams

    torch._dynamo.reset()
    model = make_model()
    base = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)
    opt = ds_zero.DeepSpeedZeroOptimizer_Stage3(model, base, config=dict(STAGE3_CFG))
    if compiled:
        model.compile(backend="eager")  # in place, as the engine's `compile()` does: the hooks stay on the module
    losses = train_steps(model, opt, rank, range(STEPS), gas=1)
    coordinator_code = (
        ParamCoordinator.pre_forward,
        ParamCoordinator.post_forward,
        ParamCoordinator.fetch_on_access,
        LiveParams.gather,
    )
    return {
        "losses": losses,
        "compiled_coordinator": {
            f.__qualname__: len(_debug_get_cache_entry_list(f.__code__)) for f in coordinator_code
        },
    }


def _both(rank: int, world: int) -> dict[str, Any]:
    return {"eager": _train(rank, world, False), "compiled": _train(rank, world, True)}


def test_compiled_model_keeps_the_hooks_out_of_the_graphs_and_trains_the_same() -> None:
    for rank, r in enumerate(run_ranks(2, _both, timeout_s=300)):
        assert r["compiled"]["losses"] == r["eager"]["losses"], rank
        assert set(r["compiled"]["compiled_coordinator"].values()) == {0}, (rank, r["compiled"])
