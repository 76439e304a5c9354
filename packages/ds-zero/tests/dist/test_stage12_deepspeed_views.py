"""DeepSpeed's names for the stage-1/2 flat buffers on 2 ranks: `parallel_partitioned_bit16_groups` and
`nccl_start_alignment_factor` (DeepSpeed's `TestPartitionNcclAlignment` reads both), and `averaged_gradients`
(its offload-states tests read it between backward and step).

Every rank sees every rank's partition as a view of its own flat buffer, in rank order; the partitions tile the
buffer; and the own partition is the one this rank's masters were cast from. (Unlike DeepSpeed's, ds's flat buffers
are padded to a multiple of the world size, not of `2 * world`, so a 16-bit partition may start 2-byte aligned.)
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from zero_dist_cases import batch, loss_fn, make_model, make_optimizer, zero_config

import ds_zero
from ds_comm.testing import run_ranks


def _views(rank: int, world: int, stage: int, dtype: torch.dtype) -> dict[str, Any]:
    model = make_model(dtype=dtype)
    opt = ds_zero.DeepSpeedZeroOptimizer(make_optimizer(model), config=zero_config(stage), module=model)
    out: dict[str, Any] = {"factor": opt.nccl_start_alignment_factor, "groups": []}
    for flat, parts, master in zip(
        opt.bit16_groups_flat, opt.parallel_partitioned_bit16_groups, opt.single_partition_of_fp32_groups, strict=True
    ):
        out["groups"].append(
            {
                "count": len(parts),
                "tiles": torch.equal(torch.cat(parts), flat),
                "views": all(p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for p in parts),
                "own_is_master": torch.equal(parts[rank].float(), master.float()),
            }
        )
    opt.close()
    return out


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_rank_sees_each_ranks_partition_of_its_flat_buffer(stage: int, dtype: torch.dtype) -> None:
    for result in run_ranks(2, _views, stage, dtype, timeout_s=120):
        assert result["factor"] == 2
        assert result["groups"], "no param group"
        for group in result["groups"]:
            assert group == {"count": 2, "tiles": True, "views": True, "own_is_master": True}


def _averaged(rank: int, world: int, stage: int, offload: bool) -> dict[str, Any]:
    """`averaged_gradients` through one step, against the mean of both ranks' plain gradients."""
    model = make_model()
    reference = make_model()
    cfg = zero_config(stage, **({"offload_optimizer": {"device": "cpu"}} if offload else {}))
    opt = ds_zero.DeepSpeedZeroOptimizer(make_optimizer(model), config=cfg, module=model)
    x, y = batch(0, 0, rank, world)
    out: dict[str, Any] = {"before": opt.averaged_gradients}
    opt.backward(loss_fn(model, x, y))
    out["after_backward"] = {g: len(v) for g, v in opt.averaged_gradients.items()}
    if stage == 1:
        opt._get_norm_groups()  # ds's stage 1 reduces here (or at step()); DeepSpeed's at the boundary backward
    views = opt.averaged_gradients
    # the reference: this rank's fragments of the data-parallel mean of the plain gradients
    loss_fn(reference, x, y).backward()
    named = dict(reference.named_parameters())
    expected: dict[int, list[torch.Tensor]] = {}
    for g, flat in enumerate(opt.flats):
        full = torch.zeros(flat.padded_numel)
        for slot in flat.slots:
            grad = named[slot.name].grad
            if grad is not None:
                full[slot.flat_offset : slot.flat_end] = grad.reshape(-1)
        torch.distributed.all_reduce(full)
        own = (full / world)[flat.own_start : flat.own_start + flat.partition_numel]
        expected[g] = [own[f.partition_start : f.partition_start + f.numel] for f in flat.fragments()]
    out["match"] = sorted(views) == sorted(expected) and all(
        len(views[g]) == len(expected[g])
        and all(torch.allclose(a.float(), b, atol=1e-6) for a, b in zip(views[g], expected[g], strict=True))
        for g in expected
    )
    opt.step()
    out["after_step"] = opt.averaged_gradients
    opt.close()
    return out


@pytest.mark.parametrize("stage", [1, 2])
def test_averaged_gradients_hold_this_ranks_reduced_fragments_between_backward_and_step(stage: int) -> None:
    for result in run_ranks(2, _averaged, stage, False, timeout_s=120):
        assert result["before"] == {} and result["after_step"] == {}
        if stage == 1:
            assert result["after_backward"] == {}  # not reduced yet: reading never reduces
        else:
            assert result["after_backward"] and all(n > 0 for n in result["after_backward"].values())
        assert result["match"]


def test_averaged_gradients_stay_empty_with_optimizer_offload() -> None:
    for result in run_ranks(2, _averaged, 2, True, timeout_s=120):
        assert result["before"] == {} and result["after_backward"] == {} and result["after_step"] == {}


def _coalesced_full_grad(rank: int, world: int, stage: int) -> dict[str, Any]:
    """Inside `coalesce_grad_reduction()`, DeepSpeed's documented `safe_get_full_grad`: the local `.grad`."""
    model = make_model()
    opt = ds_zero.DeepSpeedZeroOptimizer(make_optimizer(model), config=zero_config(stage), module=model)
    x, y = batch(0, 0, rank, world)
    weight = model.emb.weight
    with opt.coalesce_grad_reduction():
        opt.backward(loss_fn(model, x, y))
        inside = opt.get_fp32_grad_for_param(weight)
        local = weight.grad.detach().clone()
        same_tensor = inside is weight.grad
    after = opt.get_fp32_grad_for_param(weight)  # reduced at the block's exit: the mean over the ranks
    mean = local.clone()
    torch.distributed.all_reduce(mean)
    mean /= world
    opt.step()
    opt.close()
    return {"same_tensor": same_tensor, "after_is_mean": torch.allclose(after, mean.float(), atol=1e-6)}


@pytest.mark.parametrize("stage", [1, 2])
def test_full_grad_inside_a_coalesced_block_is_the_local_gradient(stage: int) -> None:
    for result in run_ranks(2, _coalesced_full_grad, stage, timeout_s=120):
        assert result == {"same_tensor": True, "after_is_mean": True}


def _partition_ids(rank: int, world: int) -> dict[str, Any]:
    """`get_param_id` / `param_to_partition_ids` against the ranks whose partition view overlaps the parameter."""
    model = make_model()
    opt = ds_zero.DeepSpeedZeroOptimizer(make_optimizer(model), config=zero_config(2), module=model)
    ids, maps, expected = [], opt.param_to_partition_ids, []
    for params, flat, parts in zip(
        opt.bit16_groups, opt.bit16_groups_flat, opt.parallel_partitioned_bit16_groups, strict=True
    ):
        size, base = flat.element_size(), flat.data_ptr()
        where: dict[int, list[int]] = {}
        for p in params:
            start = (p.data_ptr() - base) // size
            end = start + p.numel()
            owners = []
            for r, part in enumerate(parts):
                lo = (part.data_ptr() - base) // size
                if start < lo + part.numel() and lo < end:
                    owners.append(r)
            ids.append(opt.get_param_id(p))
            where[opt.get_param_id(p)] = owners
        expected.append(where)
    try:
        opt.get_param_id(torch.nn.Parameter(torch.zeros(3)))
        foreign = "no error"
    except ValueError as err:
        foreign = str(err)
    opt.close()
    return {"ids": ids, "maps": maps, "expected": expected, "foreign": foreign}


def test_param_ids_and_the_partitions_each_parameter_spans() -> None:
    for r in run_ranks(2, _partition_ids, timeout_s=120):
        assert r["ids"] == list(range(len(r["ids"])))  # counted over the groups in order, as DeepSpeed does
        assert r["maps"] == r["expected"]
        assert any(len(owners) > 1 for m in r["maps"] for owners in m.values()), "no parameter straddles ranks"
        assert "not one this ZeRO optimizer partitions" in r["foreign"]
