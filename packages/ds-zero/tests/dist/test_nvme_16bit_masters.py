"""bf16 (and fp16) master weights and gradients with the optimizer on NVMe (ZeRO-3, 2 gloo ranks).

DeepSpeed 0.19.8 runs `bf16_master_weights_and_grads` with `offload_optimizer.device: nvme` (its swapper pages
each sub-group's master in the master's own dtype; checked on this host with DeepSpeed's CPU accelerator). The
same job with the masters on NVMe must train exactly as with the masters in host memory (CPU offload, which
`test_bf16_master_weights.py` checks against plain PyTorch): the same DeepSpeedCPUAdam over the same bf16
masters and gradients, only where they are kept differs. So losses and parameters are compared bit for bit,
over 6 steps with 2 micro-steps each (the second adds to the first's gradient read back from its file), with
fp32 moments and with bf16 ones (`bf16_optimizer_states`), every sub-group updated at `step()` or during the
backward that ends the window (speculatively, `ds_zero._nvme.eager_step`; also with one micro-step a step).
The swap files hold 2 bytes an element for the masters and gradients, the moments' own width. The same for
fp16 masters (`fp16_master_weights_and_gradients`, fp32 moments), which DeepSpeed also accepts with NVMe.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from stage3_cases import STAGE3_CFG, batch, gathered_state, loss_fn, make_model

import ds_ops
import ds_zero
from ds_comm.testing import run_ranks

STEPS = 6


def _build(config: dict[str, Any], dtype: torch.dtype, states_16: bool) -> tuple[torch.nn.Module, Any]:
    model = make_model().to(dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    base = ds_ops.DeepSpeedCPUAdam(params, lr=1e-2, weight_decay=0.01, fp32_optimizer_states=not states_16)
    if dtype == torch.bfloat16:
        masters = {"bf16_master_weights_and_gradients": True, "bf16_optimizer_states": states_16}
    else:
        masters = {"fp16_master_weights_and_gradients": True}
    opt = ds_zero.DeepSpeedZeroOptimizer_Stage3(
        model,
        base,
        config={**STAGE3_CFG, "sub_group_size": 1500, **config},
        aio_config={"queue_depth": 4},
        **masters,
    )
    return model, opt


def _file_widths(swap_dir: str, tiles: list[Any]) -> dict[str, set[float]]:
    """Bytes per element of each kind of swap file (master "fp32" key, grad, moments)."""
    numel = {t.index: t.numel for t in tiles}
    widths: dict[str, set[float]] = {}
    for name in os.listdir(swap_dir):
        tile, key = name.split(".")[:2]  # tile<k>.<key>[.<slot>].swp
        index = int(tile.removeprefix("tile"))
        if numel.get(index):
            widths.setdefault(key, set()).add(os.path.getsize(os.path.join(swap_dir, name)) / numel[index])
    return widths


def _train(model: torch.nn.Module, opt: Any, rank: int, gas: int, hint: bool) -> tuple[list[float], list[int], int]:
    """Losses per step, how many sub-groups were updated during each step's last backward, and how many of
    their reads were issued while the previous one's writes were in flight."""
    losses, in_backward, reads_over_writes = [], [], 0
    for step in range(STEPS):
        total = 0.0
        for micro in range(gas):
            opt.set_step_boundary(hint and micro == gas - 1)  # the engine's hint: this backward ends the window
            idx, tgt = batch(rank, step, micro)
            loss = loss_fn(model(idx), tgt) / gas
            opt.backward(loss)
            total += loss.item()
        swapper = getattr(opt, "optimizer_swapper", None)
        eager = None if swapper is None else swapper.grads.eager
        in_backward.append(0 if eager is None else len(eager.stepped))
        reads_over_writes += 0 if eager is None else eager.num_reads_over_writes
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, in_backward, reads_over_writes


def _cpu_vs_nvme(
    rank: int, world: int, *, root: str, dtype: torch.dtype, states_16: bool, gas: int, hint: bool
) -> dict[str, Any]:
    cpu_model, cpu_opt = _build({"offload_optimizer": {"device": "cpu"}}, dtype, states_16)
    cpu_losses, _, _ = _train(cpu_model, cpu_opt, rank, gas, hint)
    nvme = {"device": "nvme", "nvme_path": root, "pipeline_read": True, "pipeline_write": True}
    model, opt = _build({"offload_optimizer": nvme}, dtype, states_16)
    losses, in_backward, reads_over_writes = _train(model, opt, rank, gas, hint)
    swapper = opt.optimizer_swapper
    return {
        "cpu_losses": cpu_losses,
        "losses": losses,
        "cpu_state": gathered_state(cpu_model),
        "state": gathered_state(model),
        "master_dtype": swapper.master_dtype,
        "widths": _file_widths(str(swapper.dir), swapper.tiles),
        "in_backward": in_backward,
        "reads_over_writes": reads_over_writes,
        "num_sets": swapper.num_sets,
    }


@pytest.mark.parametrize(
    ("dtype", "states_16", "gas", "hint"),
    [
        (torch.bfloat16, False, 2, False),
        (torch.bfloat16, True, 2, False),
        (torch.bfloat16, False, 2, True),
        (torch.bfloat16, False, 1, True),
        (torch.float16, False, 2, False),
        (torch.float16, False, 1, True),
    ],
    ids=[
        "bf16-fp32-moments-at-step",
        "bf16-bf16-moments-at-step",
        "bf16-gas2-in-backward",
        "bf16-in-backward",
        "fp16-at-step",
        "fp16-in-backward",
    ],
)
def test_masters_on_nvme_train_exactly_like_masters_in_memory(
    tmp_path: Any, dtype: torch.dtype, states_16: bool, gas: int, hint: bool
) -> None:
    results = run_ranks(
        2, _cpu_vs_nvme, root=str(tmp_path), dtype=dtype, states_16=states_16, gas=gas, hint=hint, timeout_s=240
    )
    for res in results:
        assert res["master_dtype"] == dtype
        assert res["losses"] == res["cpu_losses"]
        assert set(res["state"]) == set(res["cpu_state"])
        for name, value in res["state"].items():
            assert torch.equal(value, res["cpu_state"][name]), name
        widths = res["widths"]
        assert widths["fp32"] == {2.0}  # the master file (DeepSpeed's "fp32" key name) holds 16-bit values
        assert widths["exp_avg"] == widths["exp_avg_sq"] == {2.0 if states_16 else 4.0}
        if gas == 2:  # the first micro-step's gradient went to its file and was read back
            assert widths["grad"] == {2.0}
        if not hint:  # every sub-group updated at step()
            assert not any(res["in_backward"])
        elif gas == 2:  # the first micro-step recorded the order: from the first step on, updates in backward
            assert all(res["in_backward"])
        else:  # the first step's backward records the order, the later ones update in backward
            assert res["in_backward"][0] == 0 and all(res["in_backward"][1:])
        assert res["num_sets"] == 2  # both pipelines share the second buffer set
        if hint:  # pipeline_write: a sub-group's writes stay in flight while the next one's reads are issued
            assert res["reads_over_writes"] > 0
