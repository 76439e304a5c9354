"""ds-comm's collectives over nccl on the one GPU a single-device machine has (a world of one rank).

Two nccl ranks cannot share one GPU, so this is what a one-GPU machine can check of the nccl path:
the default backend on CUDA is nccl, the process group comes up through `ds_comm.testing.run_ranks`,
and every collective ZeRO uses (all_reduce sync and async, all_gather_into_tensor,
reduce_scatter_tensor, broadcast, barrier) runs on device tensors in fp32 and bf16 and gives the
one-rank answer (the input itself). The multi-rank semantics stay covered by the gloo tests.
"""

from __future__ import annotations

import pytest
import torch

import ds_comm
from ds_comm.testing import run_ranks

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BACKEND, DEVICE = "nccl", "cuda"


def _collectives(rank: int, world: int) -> dict[str, torch.Tensor | str]:
    import torch.distributed as dist

    device = torch.device(DEVICE, 0) if DEVICE == "cuda" else torch.device("cpu")
    out: dict[str, torch.Tensor | str] = {"backend": str(dist.get_backend())}
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.arange(1, 9, dtype=dtype, device=device)
        ds_comm.all_reduce(x)
        handle = ds_comm.all_reduce(x, async_op=True)
        handle.wait()
        gathered = torch.empty(8 * world, dtype=dtype, device=device)
        ds_comm.all_gather_into_tensor(gathered, x)
        scattered = torch.empty(8 // world, dtype=dtype, device=device)
        ds_comm.reduce_scatter_tensor(scattered, x)
        ds_comm.broadcast(x, src=0)
        ds_comm.barrier()
        for name, value in (("all_reduce", x), ("all_gather", gathered), ("reduce_scatter", scattered)):
            assert value.device.type == device.type
            out[f"{name}_{dtype}"] = value.cpu()
    return out


def test_default_backend_on_cuda_is_nccl() -> None:
    accelerator = ds_comm.get_accelerator()
    assert accelerator.name == DEVICE and accelerator.communication_backend_name() == BACKEND


def test_collectives_over_nccl_with_one_rank() -> None:
    (result,) = run_ranks(1, _collectives, backend=BACKEND, timeout_s=120)
    assert result["backend"] == BACKEND
    for dtype in (torch.float32, torch.bfloat16):
        expected = torch.arange(1, 9, dtype=dtype)
        for name in ("all_reduce", "all_gather", "reduce_scatter"):
            assert torch.equal(result[f"{name}_{dtype}"], expected), name
