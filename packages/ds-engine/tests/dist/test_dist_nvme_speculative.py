"""ZeRO-Infinity with DeepSpeed's defaults: sub-groups are updated during backward speculatively, at 1 and 2 ranks.

bf16 with `check_grad_overflow` on and `gradient_clipping` set, parameters and optimizer state on NVMe.
Each rank trains the same 8 steps three ways: stage 3 in memory (the reference), NVMe stepping every
sub-group at `step()` (`nvme_speculation = False`), and NVMe updating sub-groups during backward (the
default). Step 3 gets an inf gradient in its first layer (the step is skipped), step 5 a loss 1000x
(its global norm is far above the threshold: clipped). Checked: the speculative run's losses and weights
equal both others bit for bit; the skipped step leaves the fp32 masters, the Adam state on disk, the
step counts and the bf16 weights bit-identical to before it, after undoing the updates made during its
backward; the clipped step's updates are undone and redone with the clipped gradient; after a skipped
or clipped step the next backward does not speculate. Step 7 replaces a gradient between backward and step
(`safe_set_full_grad`): the sub-group updated from the old one is undone and updated at the step. On a disk
with room for only half of the spare files, the sub-groups that fit are updated during backward, the rest at
`step()`, with the same result.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ds_comm.testing import run_ranks

ds_zero = pytest.importorskip("ds_zero", reason="NVMe offload needs ds-zero: pip install 'ds-engine[zero]'")

CLIP = 5.0
STEPS = 8
INF_STEP = 3
SPIKE_STEP = 5
EDIT_STEP = 7
_poison = {"on": False}


class _Poison(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by inf while `_poison["on"]` (an overflow in the
    gradients of the layers before it only: the later layers' sub-groups complete first and are updated)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("inf") if _poison["on"] else grad


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(10, 40)
        self.fc2 = nn.Linear(40, 40)
        self.fc3 = nn.Linear(40, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _Poison.apply(torch.tanh(self.fc1(x)))
        return self.fc3(torch.tanh(self.fc2(h)))


def _config(nvme_path: str | None) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 500}
    if nvme_path is not None:
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 4, "buffer_size": 4096}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path, "pipeline_read": True}
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": CLIP,
        "bf16": {"enabled": True, "check_grad_overflow": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": zero,
    }


def _data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 10, generator=g), torch.randn(4, 3, generator=g)


def _weights(engine: Any) -> torch.Tensor:
    import ds_engine as deepspeed

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return torch.cat([p.detach().reshape(-1).clone() for p in engine.module.parameters()])


def _snapshot(engine: Any) -> dict[str, Any]:
    """Everything a skipped step must leave alone: each sub-group's fp32 master and Adam moments as read
    from its (committed) swap files, the step counts, and the bf16 weights."""
    opt = engine.optimizer
    sw = opt.optimizer_swapper
    out: dict[str, Any] = {"bf16": _weights(engine)}
    for tile in sw.tiles:
        out[f"{tile.index}.master"] = sw.read_tensor(tile, None)
        for key, _ in sw._keys.get(tile.index, []):
            out[f"{tile.index}.{key}"] = sw.read_tensor(tile, key)
        step = opt.optimizer.state.get(tile.master, {}).get("step")
        out[f"{tile.index}.step"] = None if step is None else torch.as_tensor(step).clone()
    return out


def _half_the_spare_room(engine: Any) -> Any:
    """A stand-in for `free_swap_bytes`: a disk with room for half of the second file set (the spare files
    already written count against it, as on a real disk)."""
    sw = engine.optimizer.optimizer_swapper
    room: list[int] = []

    def free(path: Any) -> int:
        if not room:  # first call: no spare file written yet
            room.append(sum(sw.spare_bytes_needed(t) for t in sw.tiles if t.numel) // 2)
        return room[0] - sum(f.nbytes for (_, _, slot), f in sw._files.items() if slot == 1)

    return free


def _train(
    rank: int, config: dict[str, Any], speculate: bool | None, hint: bool = True, tight_disk: bool = False
) -> dict[str, Any]:
    import ds_engine as deepspeed
    from ds_engine.utils import safe_get_full_grad, safe_set_full_grad
    from ds_zero._nvme import eager_step

    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=Net(), config=config)
    if speculate is not None:
        engine.optimizer.nvme_speculation = speculate
    if not hint:  # keep updating during the backward even once this rank's gradients show a clip is coming
        eager_step.step_known_to_change = lambda zero: False  # (this rank process runs nothing else after)
    if tight_disk:  # (the last run of this rank process)
        eager_step.free_swap_bytes = _half_the_spare_room(engine)
    losses, speculated, undone, skipped = [], [], [], {}
    before = None
    for step in range(STEPS):
        if step == INF_STEP and speculate is not None:
            before = _snapshot(engine)
        x, y = _data(rank, step)
        loss = nn.functional.mse_loss(engine(x.to(torch.bfloat16)).float(), y)
        _poison["on"] = step == INF_STEP
        try:
            engine.backward(loss * 1000.0 if step == SPIKE_STEP else loss)
        finally:
            _poison["on"] = False
        swapper = getattr(engine.optimizer, "optimizer_swapper", None)
        eager = swapper.grads.eager if swapper is not None else None
        speculated.append(len(eager.stepped) if eager is not None else 0)
        if step == EDIT_STEP:  # a gradient replaced between backward and step: its sub-group is updated anew
            weight = engine.module.fc3.weight
            safe_set_full_grad(weight, safe_get_full_grad(weight) * 0.5)
        engine.step()
        undone.append(eager.num_undone if eager is not None else 0)
        losses.append(loss.item())
        if step == INF_STEP and before is not None:
            skipped = {"before": before, "after": _snapshot(engine)}
    return {
        "losses": losses,
        "weights": _weights(engine).float(),
        "speculated": speculated,
        "undone": undone,
        "skipped": skipped,
        "skipped_steps": engine.skipped_steps,
        "disk_limit_logged": getattr(getattr(engine.optimizer, "optimizer_swapper", None), "disk_limit_logged", None),
    }


def _run(rank: int, world: int, root: str) -> dict[str, Any]:
    return {
        "plain": _train(rank, _config(None), None),
        "at_step": _train(rank, _config(f"{root}/at_step"), False),
        "speculative": _train(rank, _config(f"{root}/spec"), True),
        "no_hint": _train(rank, _config(f"{root}/no_hint"), True, hint=False),
        "tight_disk": _train(rank, _config(f"{root}/tight"), True, tight_disk=True),
    }


@pytest.mark.parametrize("world", [1, 2])
def test_speculative_updates_during_backward_equal_stepping_after_it(tmp_path: Path, world: int) -> None:
    for sub in ("at_step", "spec", "no_hint", "tight"):
        (tmp_path / sub).mkdir()
    results = run_ranks(world, _run, root=str(tmp_path), timeout_s=300)
    for rank, r in enumerate(results):
        plain, at_step, spec = r["plain"], r["at_step"], r["speculative"]
        where = f"rank {rank} of {world}"
        # (a) a normal run: the same losses and weights as stepping after the backward, and as no offload
        assert spec["losses"] == at_step["losses"] == plain["losses"], where
        torch.testing.assert_close(spec["weights"], at_step["weights"], rtol=0, atol=0, msg=where)
        torch.testing.assert_close(spec["weights"], plain["weights"], rtol=0, atol=0, msg=where)
        assert spec["skipped_steps"] == at_step["skipped_steps"] == plain["skipped_steps"] == 1, where
        assert at_step["speculated"] == [0] * STEPS, where
        # the first backward has no completion order; after the skipped (3) and clipped (5) steps: none
        for step in (1, 2, 7):
            assert spec["speculated"][step] > 0, f"{where}: step {step} updated nothing during backward"
        for step in (0, INF_STEP + 1, SPIKE_STEP + 1):
            assert spec["speculated"][step] == 0, f"{where}: step {step} speculated after a skip or clip"
        # (b) the skipped step: its in-backward updates undone, everything bit-identical to before it
        assert spec["speculated"][INF_STEP] > 0, f"{where}: nothing was updated before the inf gradient"
        assert spec["undone"][INF_STEP] == spec["speculated"][INF_STEP], where
        before, after = spec["skipped"]["before"], spec["skipped"]["after"]
        assert before.keys() == after.keys(), where
        for key, value in before.items():
            if value is None:
                assert after[key] is None, f"{where}: {key}"
            else:
                assert torch.equal(value, after[key]), f"{where}: {key} changed in the skipped step"
        # (c) the clipped step: every in-backward update undone and redone with the clipped gradient (equal
        # to no offload, above). By default the updates stop once this rank's own norm is past the threshold;
        # without that hint they go on to the end of the backward and are all redone: the same weights.
        hintless = r["no_hint"]
        assert hintless["losses"] == plain["losses"], where
        torch.testing.assert_close(hintless["weights"], plain["weights"], rtol=0, atol=0, msg=where)
        assert hintless["speculated"][SPIKE_STEP] == hintless["speculated"][2] > 0, where
        assert hintless["undone"][SPIKE_STEP] == hintless["speculated"][SPIKE_STEP], where
        assert spec["undone"][SPIKE_STEP] == spec["speculated"][SPIKE_STEP] < hintless["speculated"][SPIKE_STEP], where
        for run in (spec, hintless):
            for step in (1, 2):
                assert run["undone"][step] == 0, f"{where}: step {step} was undone"
            # step 7 replaced fc3.weight's gradient after the backward: that one sub-group was undone
            assert run["undone"][EDIT_STEP] == 1, where
        # (d) a disk with room for half the second file set: the sub-groups whose spare files fit are updated
        # during the backward, the rest at step() (said once), and the training is the same
        tight = r["tight_disk"]
        assert tight["losses"] == plain["losses"], where
        torch.testing.assert_close(tight["weights"], plain["weights"], rtol=0, atol=0, msg=where)
        for step in (1, 2, 7):
            assert 0 < tight["speculated"][step] < spec["speculated"][step], f"{where}: step {step}: {tight}"
        assert tight["disk_limit_logged"] is True, where
