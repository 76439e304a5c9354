"""engine.offload_states() / reload_states() on 2 gloo ranks, ZeRO stages 0-3: training after the round trip is
bit-identical to training without it, at a boundary and in the middle of gradient accumulation.

Two modes: "host" is what a CPU host does (the states are already in host memory, only dead gradient
memory is freed); "copy" forces the device-to-host path (`StateOffloader.copy_on_same_device`), so every
storage is really copied out, shrunk to 0 bytes and restored, as on an accelerator.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from ds_comm.testing import run_ranks

pytest.importorskip("ds_zero", reason="ZeRO through the engine needs ds-zero: pip install 'ds-engine[zero]'")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(12, 32)
        self.b = nn.Linear(32, 6)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.b(torch.tanh(self.a(x))).float(), y)


def _run(rank: int, world: int, stage: int, precision: str) -> dict[str, dict[str, object]]:
    return {
        "ref": _train(rank, stage, precision, "host", []),
        "host": _train(rank, stage, precision, "host", [2, 5]),
        "copy": _train(rank, stage, precision, "copy", [2, 5]),
    }


def _train(rank: int, stage: int, precision: str, mode: str, offload_at: list[int]) -> dict[str, object]:
    import ds_engine as deepspeed
    from ds_ops import OffloadStateTypeEnum, StateOffloader, StatesOffloadedError

    StateOffloader.copy_on_same_device = mode == "copy"
    torch.manual_seed(0)
    with deepspeed.zero.Init() if stage == 3 else contextlib.nullcontext():
        model = Net()
    config = {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 40},
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    g = torch.Generator().manual_seed(1 + rank)
    data = [(torch.randn(3, 12, generator=g), torch.randn(3, 6, generator=g)) for _ in range(8)]
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    losses, parked, refused = [], [], []
    for micro, (x, y) in enumerate(data):
        if micro in offload_at:
            engine.offload_states()
            offloader = engine._stage0_offloader if stage == 0 else engine.optimizer._state_offloader
            parked.append((sorted(k.value for k in engine._offloaded_kinds()), offloader.parked_bytes))
            try:
                engine(x.to(dtype), y)
            except StatesOffloadedError as err:
                refused.append(str(err))
            engine.reload_states()
        loss = engine(x.to(dtype), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    # two ranks of one host keep stage 1's fp32 gradients in pair memory the peer maps (ds_zero._stage12.pair_memory):
    # offload_states leaves such memory in place, as any storage it cannot resize
    pair_grads = any(s is not None for s in getattr(getattr(engine.optimizer, "_grads", None), "shared", []))
    engine.offload_states(include=[OffloadStateTypeEnum.optim_states])
    partial = sorted(k.value for k in engine._offloaded_kinds())
    engine(data[0][0].to(dtype), data[0][1])  # forward needs only the parameters
    engine.reload_states()
    with deepspeed.zero.GatheredParameters(list(model.parameters())) if stage == 3 else contextlib.nullcontext():
        weights = torch.cat([p.detach().float().reshape(-1).clone() for p in engine.module.parameters()])
    return {
        "losses": losses,
        "weights": weights,
        "parked": parked,
        "refused": refused,
        "partial": partial,
        "pair_grads": pair_grads,
    }


@pytest.mark.parametrize(
    ("stage", "precision"), [(0, "fp32"), (0, "bf16"), (1, "fp32"), (2, "bf16"), (3, "fp32"), (3, "bf16")]
)
def test_offload_reload_keeps_training_identical(stage: int, precision: str) -> None:
    # offloads before micro step 2 (a boundary just passed) and 5 (mid-accumulation: gradients are live)
    results = run_ranks(2, _run, stage=stage, precision=precision, timeout_s=180)
    every = sorted(k for k in ("optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer"))
    for rank, result in enumerate(results):
        ref = result["ref"]
        for mode in ("host", "copy"):
            ours = result[mode]
            assert ours["losses"] == ref["losses"], f"{mode} rank {rank}: losses differ after the round trip"
            assert torch.equal(ours["weights"], ref["weights"]), f"{mode} rank {rank}: weights differ"
            assert [kinds for kinds, _ in ours["parked"]] == [every, every]
            assert len(ours["refused"]) == 2
            assert "engine.forward() needs the training states lp_params" in ours["refused"][0]
            assert "reload_states()" in ours["refused"][0]
            assert ours["partial"] == ["optim_states"]
        host_bytes = [n for _, n in result["host"]["parked"]]
        copy_bytes = [n for _, n in result["copy"]["parked"]]
        if stage < 3 and not result["host"]["pair_grads"]:  # right after a step the gradient buffers are dead:
            assert host_bytes[0] > 0  # freed even on a CPU host
        # the copy path moves everything: at least this rank's half of the two fp32 Adam moments
        numel = 12 * 32 + 32 + 32 * 6 + 6
        assert min(copy_bytes) >= 4 * numel
