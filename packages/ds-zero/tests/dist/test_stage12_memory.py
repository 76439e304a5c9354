"""Memory each rank holds, counted from its tensors: fp32 master + optimizer state are 1/N of the whole
(+ padding < N elements per group) at stages 1 and 2, gradients are 1/N at stage 2, and in fp32 the
master partition is a view of the model's own flat buffer rather than a second copy."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import ds_zero
from ds_comm.testing import run_ranks

BUCKET = 1200


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 37), nn.Tanh(), nn.Linear(37, 29)).to(dtype)  # 2027 elements


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _memory(rank: int, world: int) -> dict:
    out = {}
    for stage in (1, 2):
        for dtype in (torch.float32, torch.bfloat16):
            model = _model(dtype)
            numel = sum(p.numel() for p in model.parameters())
            opt = ds_zero.DeepSpeedZeroOptimizer(
                torch.optim.Adam(model.parameters(), lr=1e-3),
                config=ds_zero.ZeroConfig(stage=stage, reduce_bucket_size=BUCKET),
                module=model,
            )
            x = torch.randn(4, 24).to(dtype)
            opt.backward(model(x).float().pow(2).mean())
            grads_after_backward = [p.grad for p in model.parameters()]
            opt.step()
            flat = opt.flats[0]
            master = opt.masters[0]
            state = opt.optimizer.state[master]
            out[(stage, str(dtype))] = {
                "numel": numel,
                "partition_numel": flat.partition_numel,
                "breakdown": opt.memory_breakdown(),
                "state_partition_elems": sum(v.numel() for v in state.values() if v.dim() == 1),
                "master_numel": master.numel(),
                "master_is_view_of_params": _same_storage(master, flat.flat),
                "grads_dropped": all(g is None for g in grads_after_backward),
                "grad_partition_elems": sum(g.numel() for g in opt.grad_partitions),
                "staging_elems": sum(t.numel() for t in opt._grads.gradient_tensors()),
                "staging_bytes": sum(t.numel() * t.element_size() for t in opt._grads.gradient_tensors()),
            }
            opt.close()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_partitioned_memory(world: int) -> None:
    for rank, per in enumerate(run_ranks(world, _memory, timeout_s=90)):
        for (stage, dtype), m in per.items():
            where = f"rank {rank} stage {stage} {dtype}"
            numel, part = m["numel"], m["partition_numel"]
            assert 0 <= part * world - numel < world, f"{where}: padding {part * world - numel} >= world"
            # Adam: exp_avg + exp_avg_sq for this rank's partition only
            assert m["state_partition_elems"] == 2 * part, where
            assert m["breakdown"]["optimizer_state"] <= 2 * part * 4 + 16, where
            assert m["master_numel"] == part, where
            model_bytes = 2 if "bfloat16" in dtype else 4
            assert m["breakdown"]["params"] == part * world * model_bytes, where
            if "float32" in dtype:
                assert m["master_is_view_of_params"], f"{where}: fp32 master must be a view of the params"
                assert m["breakdown"]["fp32_master"] == 0, where
            else:
                assert not m["master_is_view_of_params"]
                assert m["breakdown"]["fp32_master"] == part * 4, where
            grads = m["breakdown"]["gradients"]
            if stage == 2:
                # an fp32 partition of 1/N of the elements + one staging bucket (<= reduce_bucket_size, no
                # overlap_comm) + receive buffers for the other ranks' pieces of it (gloo); no full gradient
                # survives backward
                assert m["grads_dropped"], f"{where}: full gradients kept after backward"
                assert m["grad_partition_elems"] == part, where
                assert 0 < m["staging_elems"] <= BUCKET * world, where
                assert grads == part * 4 + m["staging_bytes"], f"{where}: {grads} bytes of gradients"
            else:
                # stage 1 keeps the full gradients (model dtype) by definition
                assert grads >= numel * model_bytes, where
