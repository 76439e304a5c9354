"""Tensor x sequence x data parallelism from one ds_config on 8 ranks: `"tensor_parallel": {"autotp_size": 2}`,
`"sequence_parallel_size": 2` and data parallelism over the 2 replicas left build one `ParallelDims` and one
mesh (tp innermost, then sp, then dp). AutoTP cuts attention heads and MLP, Ulysses `DistributedAttention`
spreads each rank's heads over its sequence peers, and each data-parallel replica takes its own samples.
Gradients are averaged over data x sequence ranks (DeepSpeed's seq_data_parallel group, as ALST does), so
each rank's mean loss over its own tokens trains like the mean over the whole batch. At ZeRO 1 and 2, the
losses and whole weights equal plain PyTorch on one process over the full batch (fp32, 1e-5).

Needs ds-parallel and ds-zero (the `ds-engine[all]` session); skipped without them.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch
from torch import nn

from ds_comm.testing import run_ranks

pytest.importorskip("ds_parallel", reason="tensor and sequence parallelism need ds-parallel")
pytest.importorskip("ds_zero", reason="the runs train at ZeRO stages 1 and 2: need ds-zero")

STEPS = 4
D, HEAD_DIM, MICRO, SEQ = 16, 4, 1, 8
TP, SP, DP = 2, 2, 2
LR, MOMENTUM = 0.05, 0.9
SPECS: list[dict[str, Any]] = [
    {"patterns": [r".*\.(q_proj|k_proj|v_proj|up_proj)\.weight$"], "partition_type": "column"},
    {"patterns": [r".*\.(o_proj|down_proj)\.weight$"], "partition_type": "row"},
]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Softmax attention over whole sequences, `[b, s, h, d]` in and out."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
    s = q.size(2)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


class Block(nn.Module):
    """Attention (heads cut by AutoTP's column/row layers) and an MLP, both residual."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.o_proj = nn.Linear(D, D)
        self.up_proj, self.down_proj = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.norm = nn.LayerNorm(D)
        self.attention: Any = causal_attention  # the sequence-parallel run swaps in DistributedAttention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.norm(x)
        q, k, v = (proj(h).view(b, s, -1, HEAD_DIM) for proj in (self.q_proj, self.k_proj, self.v_proj))
        x = x + self.o_proj(self.attention(q, k, v).reshape(b, s, -1))
        return x + self.down_proj(torch.tanh(self.up_proj(x)))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(D, D)  # no spec matches: whole on every rank
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return nn.functional.mse_loss(self.head(h), y)  # mean over this rank's tokens


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`: DP x MICRO samples."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(DP * MICRO, SEQ, D, generator=g), torch.randn(DP * MICRO, SEQ, 1, generator=g)


def _config(stage: int, clip: float, **extra: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": clip,  # 0: off (DeepSpeed's default is 1.0), so the gradients' scale is checked too
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": MOMENTUM}},
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "tensor_parallel": {"autotp_size": TP, "partition_config": {"use_default_specs": False, "layer_specs": SPECS}},
        "sequence_parallel_size": SP,
        **extra,
    }


def _train(rank: int, world: int, stage: int, clip: float) -> dict[str, Any]:
    import ds_engine as deepspeed
    from ds_parallel import DistributedAttention, groups

    torch.manual_seed(0)
    model = Model()
    engine, *_ = deepspeed.initialize(model=model, config=_config(stage, clip))
    ulysses = DistributedAttention(causal_attention, groups._get_sequence_parallel_group(), scatter_idx=2, gather_idx=1)
    for block in model.blocks:
        block.attention = functools.partial(ulysses, batch_dim_idx=0)  # [b, s, h, d]
    sp_rank, dp_rank = groups._get_sequence_parallel_rank(), groups._get_data_parallel_rank()
    samples = slice(dp_rank * MICRO, (dp_rank + 1) * MICRO)  # this replica's samples
    tokens = slice(sp_rank * SEQ // SP, (sp_rank + 1) * SEQ // SP)  # this rank's piece of each sequence
    losses = []
    for step in range(STEPS):
        x, y = _data(step)
        loss = engine(x[samples, tokens], y[samples, tokens])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {
        "losses": losses,
        "full": {k: v.clone() for k, v in engine.module_state_dict().items()},
        "coords": (dp_rank, sp_rank, groups._get_model_parallel_rank()),
        "sizes": (engine.dp_world_size, engine._dist.sp_world_size, engine._dist.mp_world_size),
        "train_batch_size": engine.train_batch_size(),
    }


def _reference(clip: float) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same model in plain PyTorch on one process, whole global batches, the norm clipped to `clip` (0: not)."""
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses = []
    for step in range(STEPS):
        loss = model(*_data(step))
        loss.backward()
        if clip:
            assert torch.nn.utils.clip_grad_norm_(model.parameters(), clip) > clip  # it binds: the 3-D norm is tested
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("stage", "clip"), [(1, 0.0), (2, 0.5)])
def test_tp2_sp2_dp2_equals_one_process(stage: int, clip: float) -> None:
    ref_losses, ref_state = _reference(clip)
    results = run_ranks(TP * SP * DP, _train, stage, clip, timeout_s=300)
    for rank, r in enumerate(results):
        assert r["sizes"] == (DP * SP, SP, TP)  # gradients reduce over data x sequence ranks
        assert r["train_batch_size"] == DP * MICRO
        assert r["coords"] == (rank // (TP * SP), rank // TP % SP, rank % TP)  # tp innermost, then sp, then dp
    for r in results:
        for k, v in ref_state.items():
            torch.testing.assert_close(r["full"][k], v, rtol=1e-5, atol=1e-5, msg=k)
    for step in range(STEPS):  # every rank's mean over an equal share of tokens: their mean is the whole mean
        mean = sum(r["losses"][step] for r in results) / len(results)
        assert abs(mean - ref_losses[step]) < 1e-5, (step, mean, ref_losses[step])
