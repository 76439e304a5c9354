"""Expert parallelism on 2 and 4 gloo ranks against the same experts on one rank.

Each rank routes its own batch; with ep_size > 1 its tokens reach experts on other ranks by all-to-all and
come back. Outputs must equal the all-experts model's on the same batch, dense gradients that of the
rank's own loss, and a local expert's gradient the sum of the losses' gradients over the ranks of its
expert-parallel group (all to 1e-6).
"""

from __future__ import annotations

import pytest
import torch

from ds_comm.testing import run_ranks


def _run(rank: int, world: int, ep_size: int, k: int, drop: bool) -> dict[str, float]:
    import torch.distributed as dist
    from _moe_model import TinyMoEModel, batch, expert_name, load_from_full, loss_of

    from ds_parallel import groups

    num_experts = 4
    torch.manual_seed(0)
    full = TinyMoEModel(num_experts=num_experts, ep_size=1, k=k, drop_tokens=drop)
    model = TinyMoEModel(num_experts=num_experts, ep_size=ep_size, k=k, drop_tokens=drop)
    for layer in model.moe:
        layer.set_deepspeed_parallelism()
    ep = groups._get_expert_parallel_group(f"ep_size_{ep_size}")
    ep_rank, ep_ranks = dist.get_rank(ep), dist.get_process_group_ranks(ep)
    num_local = num_experts // ep_size
    load_from_full(model, full, ep_rank, num_local)

    ids, labels = batch(rank, 0)
    logits, _ = model(ids)
    loss = loss_of(model, ids, labels)
    loss.backward()

    ref_logits, _ = full(ids)
    errors = {"logits": float((logits - ref_logits).abs().max())}
    ref_grads = {}
    for q in ep_ranks:  # every loss whose tokens may have reached this rank's experts
        full.zero_grad()
        loss_of(full, *batch(q, 0)).backward()
        ref_grads[q] = {n: p.grad.clone() for n, p in full.named_parameters()}
    worst_dense = worst_expert = 0.0
    for name, p in model.named_parameters():
        if ".deepspeed_experts." in name:
            ref = sum(ref_grads[q][expert_name(name, ep_rank, num_local)] for q in ep_ranks)
            worst_expert = max(worst_expert, float((p.grad - ref).abs().max()))
        else:
            worst_dense = max(worst_dense, float((p.grad - ref_grads[rank][name]).abs().max()))
    errors["dense_grad"] = worst_dense
    errors["expert_grad"] = worst_expert
    errors["expert_grad_norm"] = float(
        sum(p.grad.norm() ** 2 for n, p in model.named_parameters() if ".deepspeed_experts." in n)
    )
    return errors


@pytest.mark.parametrize(
    ("world", "ep_size", "k", "drop"),
    [(2, 1, 1, True), (2, 2, 1, True), (2, 2, 2, False), (4, 2, 2, True), (4, 4, 1, True), (4, 4, 3, False)],
)
@pytest.mark.timeout(300)
def test_expert_parallel_matches_all_experts_on_one_rank(world: int, ep_size: int, k: int, drop: bool) -> None:
    for errors in run_ranks(world, _run, ep_size, k, drop, timeout_s=240):
        assert errors["logits"] <= 1e-6, errors
        assert errors["dense_grad"] <= 1e-6, errors
        assert errors["expert_grad"] <= 1e-6, errors
        assert errors["expert_grad_norm"] > 0


def _groups(rank: int, world: int) -> dict[str, object]:
    from ds_parallel import groups
    from ds_parallel.moe import create_expert_groups

    out: dict[str, object] = {}
    for ep in (1, 2, 4):
        g = create_expert_groups(ep)
        out[g.name] = (g.ep_ranks, g.edp_ranks, groups._get_expert_broadcast_src_rank(g.name))
    out["dict"] = sorted(groups._get_expert_parallel_group_dict())
    out["max"] = (groups._get_max_expert_size(), groups._get_max_expert_size_name())
    out["ranks2"] = (
        groups._get_expert_parallel_group_ranks("ep_size_2"),
        groups._get_expert_data_parallel_group_ranks("ep_size_2"),
    )
    try:
        create_expert_groups(3)
    except ValueError as err:
        out["bad"] = str(err)
    return out


def test_expert_groups_follow_deepspeeds_layout() -> None:
    """ep groups are consecutive ranks, expert-data-parallel groups stride over them."""
    for rank, r in enumerate(run_ranks(4, _groups, timeout_s=120)):
        assert r["ep_size_1"] == ((rank,), (0, 1, 2, 3), 0)
        lo = rank - rank % 2
        assert r["ep_size_2"] == ((lo, lo + 1), (rank % 2, rank % 2 + 2), rank % 2)
        assert r["ep_size_4"] == ((0, 1, 2, 3), (rank,), rank)
        assert r["dict"] == ["ep_size_1", "ep_size_2", "ep_size_4"]
        assert r["max"] == (4, "ep_size_4")
        assert r["ranks2"] == ([lo, lo + 1], [rank % 2, rank % 2 + 2])
        assert "ep_size=3 must divide the data-parallel world size 4" in r["bad"]
