"""The CUDA fused_adam op on a host without CUDA: incompatible, with the reason; its .cu source compiles with nvcc.

FusedAdam on CPU tensors (the CPU fused_adam op) is tested in test_fused_adam_cpu.py."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from ds_ops import FusedAdamBuilder, OpNotCompatibleError
from ds_ops.op_builder import ABI_VERSION

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA answer")


@needs_no_cuda
def test_builder_reports_incompatible_with_the_reason() -> None:
    compatibility = FusedAdamBuilder().is_compatible()
    assert not compatibility
    assert compatibility.reasons[0].startswith("CUDA is not available")
    with pytest.raises(OpNotCompatibleError, match="op fused_adam cannot run on this machine"):
        FusedAdamBuilder().load()


def test_cuda_source_compiles_with_nvcc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    builder = FusedAdamBuilder()
    if builder.nvcc_command() is None:
        pytest.skip("nvcc not installed")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0")  # one target keeps the compile to a few seconds
    assert "-gencode=arch=compute_80,code=sm_80" in builder.nvcc_args()
    library_path = builder.build(tmp_path / "fused_adam")
    assert library_path.is_file()
    library = ctypes.CDLL(str(library_path))  # cudart is static: loads without a driver
    assert library.ds_op_abi_version() == ABI_VERSION
    assert hasattr(library, "ds_fused_adam_step")


def test_bad_arch_list_is_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    builder = FusedAdamBuilder()
    if builder.nvcc_command() is None:
        pytest.skip("nvcc not installed")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;Volta")
    reasons = builder.can_build().reasons
    assert any("TORCH_CUDA_ARCH_LIST entry 'Volta'" in reason for reason in reasons), reasons
