"""`deepspeed.git_version_info`: what this installation is (version, build commit, ops, torch).

DeepSpeed writes these at build time. A ds wheel records no commit, so `git_hash` and `git_branch`
are `"[none]"`, DeepSpeed's own value for a build without git information. `installed_ops` says which
ops are prebuilt into the ds-ops wheel. They, `compatible_ops` (each op's compiler probe, for the
implementation the accelerator uses, as in DeepSpeed: `fused_adam` is the CPU op on a CPU host), `torch_info`
and `accelerator_name` are found on first access, since importing must not probe anything.
"""

from __future__ import annotations

import functools
from typing import Any

from ds_engine.__about__ import __version__
from ds_ops.op_builder import host_op_builders

__all__ = [
    "accelerator_name",
    "compatible_ops",
    "git_branch",
    "git_hash",
    "installed_ops",
    "torch_info",
    "version",
]

version = __version__
git_hash = "[none]"
git_branch = "[none]"
# found on first access (module __getattr__)
installed_ops: dict[str, bool]
compatible_ops: dict[str, bool]
torch_info: dict[str, Any]
accelerator_name: str


@functools.cache
def _installed_ops() -> dict[str, bool]:
    return {name: builder().prebuilt_installed() for name, builder in host_op_builders().items()}


@functools.cache
def _compatible_ops() -> dict[str, bool]:
    # each op as this accelerator builds it (fused_adam on a CPU accelerator: the CPU Adam kernel)
    found = {name: bool(builder().is_compatible()) for name, builder in host_op_builders().items()}
    return {**found, "deepspeed_not_implemented": False}


@functools.cache
def _torch_info() -> dict[str, Any]:
    import torch

    cuda = torch.version.cuda or "0.0"
    nccl = "0.0"
    if torch.version.cuda and torch.distributed.is_nccl_available():
        nccl = ".".join(str(part) for part in torch.cuda.nccl.version())
    return {
        "version": ".".join(torch.__version__.split("+")[0].split(".")[:2]),
        "bf16_support": bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported()),
        "cuda_version": ".".join(cuda.split(".")[:2]),
        "nccl_version": nccl,
        "hip_version": ".".join((torch.version.hip or "0.0").split(".")[:2]),
    }


def __getattr__(name: str) -> Any:
    if name == "installed_ops":
        return _installed_ops()
    if name == "compatible_ops":
        return _compatible_ops()
    if name == "torch_info":
        return _torch_info()
    if name == "accelerator_name":
        from ds_comm import get_accelerator

        return get_accelerator().name
    raise AttributeError(f"module 'ds_engine.git_version_info' has no attribute {name!r}")
