"""`CUDAOpBuilder`: an op with .cu sources compiled by nvcc into a plain shared library.

The kernels take raw device pointers and a `cudaStream_t`, so, like the CPU ops, they include no
torch header and load through ctypes; cudart is linked statically by nvcc's default. They share the
device's primary context with torch, and run on the stream torch passes them.
"""

from __future__ import annotations

import os
import re

from ds_ops.op_builder._base import OpBuilder
from ds_ops.op_builder._cache import torch_version
from ds_ops.op_builder._toolchain import find_nvcc, probe_compiler

# Compiled when neither $TORCH_CUDA_ARCH_LIST nor a visible device says otherwise: Ampere and
# Hopper machine code, plus PTX that newer GPUs JIT-compile.
DEFAULT_CUDA_ARCHS = ("8.0", "9.0+PTX")

_PROBE_CU = """#include <cuda_runtime.h>
__global__ void ds_probe_kernel(float* x) { x[threadIdx.x] += 1.0f; }
extern "C" int ds_probe(float* x, void* stream) {
  ds_probe_kernel<<<1, 32, 0, static_cast<cudaStream_t>(stream)>>>(x);
  return static_cast<int>(cudaGetLastError());
}
"""


def parse_arch_list(text: str) -> list[str]:
    """`"8.0;9.0+PTX"` (or space-separated, torch's TORCH_CUDA_ARCH_LIST syntax) as a list.

    Raises:
        ValueError: an entry is not `<major>.<minor>[+PTX]`; the message names the entry.
    """
    archs = [item for item in re.split(r"[;\s]+", text.strip()) if item]
    for arch in archs:
        if not re.fullmatch(r"\d+\.\d+[a-z]?(\+PTX)?", arch):
            raise ValueError(
                f"TORCH_CUDA_ARCH_LIST entry {arch!r} is not like '9.0' or '9.0+PTX'; fix the variable (got {text!r})"
            )
    return archs


def gencode_flags(archs: list[str]) -> list[str]:
    """nvcc `-gencode` flags for `archs` (machine code for each, PTX where `+PTX`)."""
    flags = []
    for arch in archs:
        number = arch.removesuffix("+PTX").replace(".", "")
        flags.append(f"-gencode=arch=compute_{number},code=sm_{number}")
        if arch.endswith("+PTX"):
            flags.append(f"-gencode=arch=compute_{number},code=compute_{number}")
    return flags


class CUDAOpBuilder(OpBuilder):
    """A builder whose sources include .cu files; needs nvcc to build and a CUDA device to run."""

    def cuda_archs(self) -> list[str]:
        """The targets compiled for, as `filter_ccs` keeps them.

        From $TORCH_CUDA_ARCH_LIST, else the visible devices' capabilities, else `DEFAULT_CUDA_ARCHS`.

        Raises:
            ValueError: $TORCH_CUDA_ARCH_LIST is malformed, or `filter_ccs` leaves no target; the message
                names the op and what was asked.
        """
        configured = os.environ.get("TORCH_CUDA_ARCH_LIST")
        if configured:
            archs = parse_arch_list(configured)
        else:
            import torch  # noqa: PLC0415 - only CUDA builds ask torch about devices

            if torch.cuda.is_available():
                capabilities = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
                archs = [f"{major}.{minor}" for major, minor in sorted(capabilities)]
            else:
                archs = list(DEFAULT_CUDA_ARCHS)
        kept = [".".join(parts) for parts in self.filter_ccs(archs)]
        if not kept:
            raise ValueError(f"op {self.name} supports none of the CUDA targets {archs}; set TORCH_CUDA_ARCH_LIST")
        return kept

    def filter_ccs(self, ccs: list[str]) -> list[list[str]]:
        """The compute capabilities this op compiles for, each split at its dot (`"8.0+PTX"` -> `["8", "0+PTX"]`).

        Every one by default; an op whose kernels need newer hardware drops the rest (and says so with
        `warning`). The split form is DeepSpeed's contract for this method.
        """
        return [cc.split(".") for cc in ccs]

    def simd_level(self) -> str:
        """CUDA ops use no CPU SIMD flags, so a prebuilt one runs on any CPU."""
        return "none"

    def nvcc_command(self) -> str | None:
        return find_nvcc()

    def nvcc_args(self) -> list[str]:
        return [
            "-O3",
            "-std=c++17",
            "-Xcompiler",
            "-fPIC",
            "-Xcompiler",
            "-fvisibility=hidden",
            *gencode_flags(self.cuda_archs()),
            *(f"-I{path}" for path in self.include_paths()),
        ]

    def cxx_args(self) -> list[str]:
        return ["-O3", "-std=c++17", "-fPIC", "-fvisibility=hidden", *(f"-I{path}" for path in self.include_paths())]

    def extra_ldflags(self) -> list[str]:
        return ["-shared"]

    def build_problems(self) -> list[str]:
        problems = super().build_problems()
        if self.nvcc_command() is None:
            problems.append("nvcc not found (set $CUDA_HOME or put the CUDA toolkit's bin on PATH)")
        return problems

    def flag_problems(self, compiler: str) -> list[str]:
        """Compile a probe kernel with this op's nvcc flags (catches an arch this nvcc cannot target)."""
        nvcc = self.nvcc_command()
        if nvcc is None:
            return []
        try:
            flags = tuple(flag for flag in self.nvcc_args() if not flag.startswith("-I"))
        except ValueError as err:
            return [str(err)]
        ok, message = probe_compiler(nvcc, (*flags, "-shared"), (), _PROBE_CU, suffix=".cu")
        return [] if ok else [f"nvcc cannot compile with this op's flags: {message}"]

    def runtime_problems(self) -> list[str]:
        import torch  # noqa: PLC0415 - asked only when a CUDA op is about to be used

        if torch.version.cuda is None:
            return [f"CUDA is not available: torch {torch_version()} is built without CUDA"]
        if not torch.cuda.is_available():
            return ["CUDA is not available: no CUDA device is visible (torch.cuda.is_available() is False)"]
        return []
