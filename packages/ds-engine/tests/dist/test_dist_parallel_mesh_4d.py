"""Tensor x sequence x expert x data parallelism from one ds_config on 8 ranks, against one process.

`"tensor_parallel": {"autotp_size": 2}` and `"sequence_parallel_size": 2` with data parallelism over the 2
replicas left build one `ParallelDims` and one mesh (tp innermost, then sp, then dp). AutoTP cuts attention
heads and MLP, Ulysses `DistributedAttention` spreads each rank's heads over its sequence peers, and each
data-parallel replica takes its own samples. Gradients are averaged over data x sequence ranks (the
sequence-data-parallel group), so each rank's mean loss over its own equal share of tokens trains like
the mean over the whole batch (what ALST's `aggregate_sp_loss` gives, SP peers agreeing). At ZeRO 1
(unclipped: the gradients' scale is checked), 2 and 3 (clipped: the norm over all three dims is checked),
losses and whole weights equal plain PyTorch on one process over the full batch (fp32, 1e-5).

An MoE FFN (4 experts, ep_size=2) in the same job trains like all experts on one process too, clipped: beside
TP2 x SP2 x DP2 in DeepSpeed's expert groups (ZeRO 2, and 0 with its MoE stepper), and at SP2 x DP4 as the
`ep` dim of the one mesh (ZeRO 2).
Expert groups that split a tensor-parallel group are refused.

Needs ds-parallel and ds-zero (the `ds-engine[all]` session); skipped without them.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import nn

from ds_comm.testing import run_ranks

pytest.importorskip("ds_parallel", reason="tensor and sequence parallelism need ds-parallel")
pytest.importorskip("ds_zero", reason="the runs train at ZeRO stages 1-3: need ds-zero")

STEPS = 4
BATCH, SEQ = 4, 8
WORLD, SP = 8, 2  # data parallelism takes the ranks tensor x sequence parallelism leave
NUM_EXPERTS, EP = 4, 2
LR, MOMENTUM = 0.05, 0.9
from tp_sp_block import SPECS, Block, D, causal_attention  # noqa: E402 - tests/dist is on the path


def _expert() -> nn.Module:
    return nn.Sequential(nn.Linear(D, 2 * D), nn.Tanh(), nn.Linear(2 * D, D))  # names match no AutoTP spec


class ReferenceMoE(nn.Module):
    """Top-1 routing over all experts on one process, in plain PyTorch, with ds MoE's parameter names.

    Without capacity dropping a token's output is its gate probability times its expert's output, whatever
    else is in the batch: the sharded MoE must give the same on any split of the tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.deepspeed_moe = nn.Module()
        self.deepspeed_moe.gate = nn.Module()
        self.deepspeed_moe.gate.wg = nn.Linear(D, NUM_EXPERTS, bias=False)
        self.deepspeed_moe.experts = nn.Module()
        self.deepspeed_moe.experts.deepspeed_experts = nn.ModuleList([_expert() for _ in range(NUM_EXPERTS)])

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        x = h.reshape(-1, D)
        gates = self.deepspeed_moe.gate.wg(x).softmax(dim=1)
        choice = gates.argmax(dim=1, keepdim=True)
        outputs = torch.stack([e(x) for e in self.deepspeed_moe.experts.deepspeed_experts], dim=1)  # [n, E, D]
        picked = outputs.gather(1, choice.unsqueeze(-1).expand(-1, 1, D)).squeeze(1)
        return (gates.gather(1, choice) * picked).reshape(h.shape), None, None


def _moe(ep: int) -> nn.Module:
    """ep 0: the one-process reference; else ds MoE sharded over `ep` ranks (no dropping, no noise)."""
    if ep == 0:
        return ReferenceMoE()
    from ds_parallel.moe import MoE

    return MoE(D, _expert(), num_experts=NUM_EXPERTS, ep_size=ep, k=1, min_capacity=1, drop_tokens=False, use_rts=False)


class Model(nn.Module):
    """Embedding, two blocks, an optional MoE FFN (`moe_ep`: None none, 0 the reference, N ds MoE at ep N), head."""

    def __init__(self, moe_ep: int | None = None) -> None:
        super().__init__()
        self.embed = nn.Linear(D, D)  # no spec matches: whole on every rank
        self.blocks = nn.ModuleList([Block(), Block()])
        self.moe = None if moe_ep is None else _moe(moe_ep)
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        if self.moe is not None:
            h = h + self.moe(h)[0]  # l_aux left out: a product of batch means, it is not additive over shards
        return nn.functional.mse_loss(self.head(h), y)  # mean over this rank's tokens


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`: BATCH samples, split over the data-parallel replicas."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, SEQ, D, generator=g), torch.randn(BATCH, SEQ, 1, generator=g)


def _config(stage: int, clip: float, tp: int, sp: int = SP) -> dict[str, Any]:
    tensor_parallel = {"autotp_size": tp, "partition_config": {"use_default_specs": False, "layer_specs": SPECS}}
    return {
        "train_micro_batch_size_per_gpu": BATCH * tp * sp // WORLD,
        "gradient_clipping": clip,  # 0: off (DeepSpeed's default is 1.0), so the gradients' scale is checked too
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": MOMENTUM}},
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "sequence_parallel_size": sp,
        **({"tensor_parallel": tensor_parallel} if tp > 1 else {}),
    }


def _local_experts(state: dict[str, torch.Tensor], ep_rank: int) -> dict[str, torch.Tensor]:
    """The reference's whole state as an expert-parallel rank holds it: its experts renumbered from 0."""
    per_rank, out = NUM_EXPERTS // EP, {}
    for name, value in state.items():
        head, sep, tail = name.partition(".deepspeed_experts.")
        if not sep:
            out[name] = value
            continue
        index, _, rest = tail.partition(".")
        if int(index) // per_rank == ep_rank:
            out[f"{head}{sep}{int(index) % per_rank}.{rest}"] = value
    return out


def _expert_rank(rank: int, tp: int) -> int:
    """Where `rank` sits in its expert-parallel group. Beside tensor parallelism DeepSpeed's layout: EP
    consecutive ranks. Otherwise the mesh's `ep` dim, inside data parallelism (outside sequence parallelism)."""
    return rank % EP if tp > 1 else rank // SP % EP


def _initial(moe: bool) -> Model:
    torch.manual_seed(0)
    return Model(moe_ep=0 if moe else None)


def _train(rank: int, world: int, stage: int, clip: float, moe: bool = False, tp: int = 2) -> dict[str, Any]:
    import ds_engine as deepspeed
    from ds_parallel import DistributedAttention, groups

    model = _initial(moe)
    ep_rank = _expert_rank(rank, tp)
    if moe:
        whole = model.state_dict()
        model = Model(moe_ep=EP)
        model.load_state_dict(_local_experts(whole, ep_rank))
    engine, *_ = deepspeed.initialize(model=model, config=_config(stage, clip, tp))
    ulysses = DistributedAttention(causal_attention, groups._get_sequence_parallel_group(), scatter_idx=2, gather_idx=1)
    for block in model.blocks:
        block.attention = functools.partial(ulysses, batch_dim_idx=0)  # [b, s, h, d]
    sp_rank, dp_rank = groups._get_sequence_parallel_rank(), groups._get_data_parallel_rank()
    micro = BATCH * tp * SP // WORLD
    samples = slice(dp_rank * micro, (dp_rank + 1) * micro)  # this replica's samples
    tokens = slice(sp_rank * SEQ // SP, (sp_rank + 1) * SEQ // SP)  # this rank's piece of each sequence
    losses = []
    for step in range(STEPS):
        x, y = _data(step)
        loss = engine(x[samples, tokens], y[samples, tokens])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    expert_ranks = groups._get_expert_parallel_group_ranks(f"ep_size_{EP}") if moe else None
    return {
        "losses": losses,
        "full": {k: v.clone() for k, v in engine.module_state_dict().items()},
        "expert": (ep_rank, expert_ranks),
        "mesh_ep": (groups.get_mesh().dims.ep, groups.get_mesh().ranks("ep")),  # the one mesh initialize() built
        "coords": (dp_rank, sp_rank, groups._get_model_parallel_rank()),
        "sizes": (engine.dp_world_size, engine._dist.sp_world_size, engine._dist.mp_world_size),
        "train_batch_size": engine.train_batch_size(),
    }


def _reference(clip: float, moe: bool = False) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same model in plain PyTorch on one process, whole global batches, the norm clipped to `clip` (0: not)."""
    model = _initial(moe)
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


def _check(results: list[dict[str, Any]], reference: tuple[list[float], dict[str, torch.Tensor]], moe: bool) -> None:
    """Every rank's weights (its own experts renumbered) and the mean of the ranks' losses equal the reference."""
    ref_losses, ref_state = reference
    for r in results:
        expected = _local_experts(ref_state, r["expert"][0]) if moe else ref_state
        assert r["full"].keys() == expected.keys()
        for k, v in expected.items():
            torch.testing.assert_close(r["full"][k], v, rtol=1e-5, atol=1e-5, msg=k)
    for step in range(STEPS):  # every rank's mean over an equal share of tokens: their mean is the whole mean
        mean = sum(r["losses"][step] for r in results) / len(results)
        assert abs(mean - ref_losses[step]) < 1e-5, (step, mean, ref_losses[step])


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("stage", "clip"), [(1, 0.0), (2, 0.5), (3, 0.5)])
def test_tp2_sp2_dp2_equals_one_process(stage: int, clip: float) -> None:
    results = run_ranks(WORLD, _train, stage, clip, timeout_s=300)
    tp, dp = 2, WORLD // (2 * SP)
    for rank, r in enumerate(results):
        assert r["sizes"] == (dp * SP, SP, tp)  # gradients reduce over data x sequence ranks
        assert r["train_batch_size"] == BATCH
        assert r["coords"] == (rank // (tp * SP), rank // tp % SP, rank % tp)  # tp innermost, then sp, then dp
    _check(results, _reference(clip), moe=False)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("tp", "stage"), [(2, 2), (2, 0), (1, 2)])
def test_moe_at_ep2_equals_one_process(tp: int, stage: int) -> None:
    """An MoE FFN with 4 experts at ep_size=2 in the same job (ZeRO 2 or 0, clipped). tp 2 (TP2 x SP2 x DP2):
    DeepSpeed's expert groups beside tensor parallelism, 2 consecutive ranks (the tensor-parallel peers, which
    split each token set's slots between them). tp 1 (SP2 x DP4): the `ep` dim of the one mesh initialize()
    builds, inside data parallelism.
    Either way expert gradients are reduced over every rank holding the same experts (data x sequence)."""
    results = run_ranks(WORLD, _train, stage, 0.5, True, tp, timeout_s=300)
    stride = 1 if tp > 1 else SP
    for rank, r in enumerate(results):
        ep_rank, expert_ranks = r["expert"]
        assert expert_ranks == [rank + (i - ep_rank) * stride for i in range(EP)]
        if tp == 1:  # the expert groups are the engine's mesh's `ep` dim (one ParallelDims: sp 2, dp 4, ep 2)
            assert r["mesh_ep"] == (EP, expert_ranks)
        else:
            assert r["mesh_ep"][0] == 1
    _check(results, _reference(0.5, moe=True), moe=True)


def _expert_groups_splitting_tp(rank: int, world: int) -> str:
    import ds_engine as deepspeed

    torch.manual_seed(0)
    try:
        deepspeed.initialize(model=Model(moe_ep=EP), config=_config(1, 1.0, tp=world, sp=1))
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.timeout(300)
def test_expert_groups_that_split_a_tensor_parallel_group_are_refused() -> None:
    """ep_size=2 beside autotp_size=4: DeepSpeed's expert groups (2 consecutive ranks) split each tensor-parallel
    group, whose peers then hold some experts twice; refused at initialize(), naming the keys to change."""
    for msg in run_ranks(4, _expert_groups_splitting_tp, timeout_s=240):
        assert "MoE ep_size_2 with a tensor-parallel group of 4 ranks" in msg
        assert "use an ep_size that is 1 or a multiple of tensor_parallel.autotp_size" in msg
