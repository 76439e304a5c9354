"""ZeRO-3 ZenFlow's checkpoint (`ZenFlowZeroOptimizer_Stage3.state_dict` / `load_state_dict`) on 2 gloo ranks.

A run saved after `k` micro steps and resumed into a fresh optimizer (built from other weights, so that
everything must come from the checkpoint) must end with exactly the weights of the uninterrupted run
(tolerance 0: the same operations on the same values). Schedule: a reselection every 4 micro steps, a
CPU update every 2, one warm-up step; `k` = 3 (the step before a reselection, just after a CPU update),
5 (mid-window: the accumulators and the selective moments are live) and 6 (just after a CPU update,
mid-selection). Also with 16-bit shards and the selective moments on the host (`zenflow.offload`): the
fp32 masters of the selected elements are stale by design, the save takes those from the shards, and
the resumed bf16 run still equals the uninterrupted one exactly.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from zenflow_math import LR, WD

import ds_ops
import ds_zero
from ds_comm.testing import run_ranks

STEPS, UPDATE = 10, 2
SECTION = {"topk_ratio": 0.3, "select_strategy": "step", "select_interval": 4, "update_interval": UPDATE,
           "full_warm_up_rounds": 1}  # fmt: skip


def _build(
    seed: int, dtype: torch.dtype, host_moments: bool, *, stage: int = 3, overlap: bool = False
) -> tuple[nn.Module, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 7), nn.Tanh(), nn.Linear(7, 3)).to(dtype)
    config: dict[str, Any] = {
        "stage": stage,
        "offload_optimizer": {"device": "cpu"},
        "overlap_comm": True,
        "zenflow": dict(SECTION, offload=host_moments, overlap_step=overlap),
    }
    base = ds_ops.ZenFlowCPUAdam(model.parameters(), lr=LR, weight_decay=WD)
    selective = {"lr": LR, "weight_decay": WD}
    if stage == 3:
        config["stage3_param_persistence_threshold"] = 0
        return model, ds_zero.ZenFlowZeroOptimizer_Stage3(
            model, base, config=config, selective_optimizer_params=selective
        )
    opt = ds_zero.ZenFlowZeroOptimizer(
        base, config=ds_zero.ZeroConfig(**config), module=model, selective_optimizer_params=selective
    )
    return model, opt


def _close(opt: Any) -> None:
    (opt.destroy if hasattr(opt, "destroy") else opt.close)()


def _run(model: nn.Module, opt: Any, rank: int, steps: range, dtype: torch.dtype) -> None:
    for m in steps:
        g = torch.Generator().manual_seed(1000 * m + rank)
        x, y = torch.randn(5, 12, generator=g), torch.randn(5, 3, generator=g)
        opt.backward(nn.functional.mse_loss(model(x.to(dtype)).float(), y) / UPDATE)
        if opt.zenflow_schedule.is_update_boundary(m):
            assert opt.step() is True
        opt.zero_grad()


def _weights(model: nn.Module) -> list[torch.Tensor]:
    if not ds_zero.is_zero_param(next(model.parameters())):
        return [p.detach().float().clone() for p in model.parameters()]
    with ds_zero.GatheredParameters(list(model.parameters())):
        return [p.detach().float().clone() for p in model.parameters()]


def _resume_gap(rank: int, k: int, dtype: torch.dtype, host_moments: bool) -> tuple[float, list[Any]]:
    model, opt = _build(3, dtype, host_moments)
    _run(model, opt, rank, range(STEPS), dtype)
    whole = _weights(model)
    opt.destroy()
    model, opt = _build(3, dtype, host_moments)
    _run(model, opt, rank, range(k), dtype)
    saved = opt.state_dict()
    assert saved["zenflow"]["micro_step"] == k - 1
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, saved)
    opt.destroy()
    model, opt = _build(99, dtype, host_moments)  # other weights: all of it must come from the checkpoint
    opt.load_state_dict(states)
    assert opt.micro_step == k - 1
    _run(model, opt, rank, range(k, STEPS), dtype)
    resumed = _weights(model)
    opt.destroy()
    return max(float((a - b).abs().max()) for a, b in zip(resumed, whole, strict=True)), states


def _rank(rank: int, world: int, cases: list[tuple[int, torch.dtype, bool]]) -> tuple[list[float], list[Any]]:
    results = [_resume_gap(rank, k, dtype, host) for k, dtype, host in cases]
    return [gap for gap, _ in results], results[0][1]


def test_resume_equals_the_uninterrupted_run() -> None:
    cases = [(3, torch.float32, False), (5, torch.float32, False), (6, torch.float32, False), (5, torch.bfloat16, True)]
    results = run_ranks(2, _rank, cases, timeout_s=300)
    for rank_gaps, _ in results:
        for (k, dtype, host), gap in zip(cases, rank_gaps, strict=True):
            assert gap == 0.0, f"resumed after {k} micro steps ({dtype}, host moments {host}): max |diff| {gap:.2e}"
    # The 2-rank save of the first case, loaded on 1 rank: ZenFlow's state belongs to the 2 ranks' shards.
    run_ranks(1, _rank_other_world, results[0][1], timeout_s=120)


def _rank_other_world(rank: int, world: int, states: list[Any]) -> None:
    model, opt = _build(99, torch.float32, False)
    with pytest.raises(ValueError, match="zero_optimization.zenflow: the checkpoint's ZenFlow state was saved on 2"):
        opt.load_state_dict(states)
    opt.load_state_dict(states, load_optimizer_states=False)  # the weights re-partition; ZenFlow starts afresh
    assert opt.micro_step == 2 and all(sc.selected_columns is None for cols in opt.shard_columns for sc in cols)
    _run(model, opt, rank, range(3, STEPS), torch.float32)
    opt.destroy()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("stage", "k"), [(2, 6), (3, 5)])
def test_overlap_step_resumes_exactly(stage: int, k: int) -> None:
    """`overlap_step: true` in one process (a harness rank cannot start the worker): the save waits for the
    update in flight and takes the worker's moments, the pending result and the delayed model; the resumed
    run (a new worker) equals the uninterrupted one exactly."""
    model, opt = _build(3, torch.float32, False, stage=stage, overlap=True)
    _run(model, opt, 0, range(STEPS), torch.float32)
    whole = _weights(model)
    _close(opt)
    model, opt = _build(3, torch.float32, False, stage=stage, overlap=True)
    _run(model, opt, 0, range(k), torch.float32)
    saved = opt.state_dict()
    assert saved["zenflow"]["overlap"]["worker_optimizers"] is not None
    _close(opt)
    model, opt = _build(99, torch.float32, False, stage=stage, overlap=True)
    opt.load_state_dict([saved])
    _run(model, opt, 0, range(k, STEPS), torch.float32)
    resumed = _weights(model)
    _close(opt)
    gap = max(float((a - b).abs().max()) for a, b in zip(resumed, whole, strict=True))
    assert gap == 0.0, f"overlap_step, stage {stage}, resumed after {k}: max |diff| {gap:.2e}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [2, 3])
def test_overlap_step_hands_the_accumulators_over(stage: int) -> None:
    """`overlap_step`: the optimizer accumulates each window straight into one of the worker's two shared
    sets, and after the window's step its accumulators are the other set, already cleared by the worker:
    no copy of the window's gradients and no clearing in the training process."""
    model, opt = _build(3, torch.float32, False, stage=stage, overlap=True)
    cpu = opt._cpu
    accumulators = opt.grad_partitions if stage == 2 else opt.accumulators
    assert [a.data_ptr() for a in accumulators] == [s.data_ptr() for s in cpu.sets[0]]
    assert all(a.is_shared() for a in accumulators)
    filled = []
    for m in range(STEPS):
        _run(model, opt, 0, range(m, m + 1), torch.float32)
        if opt.zenflow_schedule.is_update_boundary(m):
            cpu.wait()  # the worker clears a set before it answers
            filled.append(cpu._filling)
            assert all(a is s for a, s in zip(accumulators, cpu.sets[cpu._filling], strict=True))
            assert all(float(a.abs().max()) == 0.0 for a in accumulators if a.numel())
        else:
            assert any(float(a.abs().max()) > 0.0 for a in accumulators)  # this window's gradients so far
    assert filled[:4] == [1, 0, 1, 0]
    _close(opt)


class _SpyConnection:
    """The worker's pipe, recording the values of the set each "step" command names as it is sent."""

    def __init__(self, conn: Any, sets: list[list[torch.Tensor]]) -> None:
        self._conn, self._sets, self.sent = conn, sets, []

    def send(self, message: tuple[Any, ...]) -> None:
        if message[0] == "step":
            self.sent.append([t.clone() for t in self._sets[message[2]]])
        self._conn.send(message)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


@pytest.mark.timeout(300)
def test_overlap_step_copies_a_gradient_that_is_not_a_view_of_its_set() -> None:
    """A caller that hands over gradients living elsewhere (an accumulator replaced from outside) has them
    copied into the set being filled before the worker is told: the worker only ever reads its shared sets."""
    model, opt = _build(3, torch.float32, False, stage=2, overlap=True)
    cpu = opt._cpu
    filled = cpu._filling
    before = [t.data_ptr() for t in cpu.sets[filled]]
    elsewhere = [torch.full_like(t, 0.25) for t in cpu.sets[filled]]
    cpu._start()
    spy = _SpyConnection(cpu._conn, cpu.sets)
    cpu._conn = spy
    cpu.submit(elsewhere, state=0, step_id=1)
    cpu.wait()
    assert [t.data_ptr() for t in cpu.sets[filled]] == before
    (handed,) = spy.sent
    assert sum(t.numel() for t in handed) > 0 and all(bool((t == 0.25).all()) for t in handed)
    assert all(float(t.abs().max()) == 0.0 for t in cpu.sets[filled] if t.numel())  # the worker cleared it
    assert all(a is t for a, t in zip(cpu.accumulators, cpu.sets[1 - filled], strict=True))
    _close(opt)


@pytest.mark.timeout(300)
def test_overlap_step_swaps_a_host_model_buffer_instead_of_copying() -> None:
    """At stage 1/2 with the model in host memory, the worker writes each result into the flat buffer the
    model is not using, and the window's end points the parameters at it (no copy of the result)."""
    model, opt = _build(3, torch.float32, False, stage=2, overlap=True)
    results = opt._cpu.results
    assert type(results).__name__ == "SwappedBuffers"
    buffers = [[b.data_ptr() for b in pair] for pair in results.buffers]
    live = []
    for m in range(STEPS):
        _run(model, opt, 0, range(m, m + 1), torch.float32)
        flat = opt.flats[0]
        which = buffers[0].index(flat.flat.data_ptr())
        live.append(which)
        flat.check_views()  # every parameter is a view of the live buffer
        assert flat.flat.is_shared()
    # a swap at every window's end (warm-up included) but the first one after warm-up, which applies nothing
    boundaries = [m for m in range(STEPS) if opt.zenflow_schedule.is_update_boundary(m)]
    swaps = [m for m in boundaries if m != SECTION["full_warm_up_rounds"] + UPDATE - 1]
    expected, which = [], 0
    for m in range(STEPS):
        which ^= m in swaps
        expected.append(which)
    assert boundaries == [0, 2, 3, 4, 6, 7, 8] and live == expected, (boundaries, live)
    _close(opt)
