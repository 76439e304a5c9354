"""`EvoformerAttnBuilder`: DeepSpeed4Science's Evoformer attention op, with CUTLASS found and reported, and no kernel.

DeepSpeed compiles this op from its own CUDA sources (`csrc/deepspeed4science/evoformer_attn`,
written against CUTLASS's templates). ds-ops ships no Evoformer kernel, so this builder never
builds: `is_compatible()` is False with that reason, and `load()` raises `OpNotCompatibleError`
saying so. What it does do is what a build would start from, with DeepSpeed's semantics: it finds
CUTLASS (see `_cutlass` for where it looks), checks its version, keeps only Tensor Core targets
(compute capability 7.0 and up) and gives the nvcc flags, so `ds_report`-style checks and scripts
that inspect the builder see the host as DeepSpeed would.

CUTLASS_PATH selects CUTLASS explicitly: a checkout, an install prefix or its include folder;
`DS_USE_CUTLASS_PYTHON_BINDINGS` means the `nvidia-cutlass` package, and `DS_IGNORE_CUTLASS_DETECTION`
means the compiler already finds it (no include folders are added, nothing is checked).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from ds_ops.op_builder import _cutlass
from ds_ops.op_builder._base import OpNotCompatibleError
from ds_ops.op_builder._cuda import CUDAOpBuilder

#: The oldest CUTLASS DeepSpeed's Evoformer kernels compile with.
MIN_CUTLASS_VERSION = (3, 1, 0)
#: Evoformer's kernels use Tensor Cores, which start at compute capability 7.0 (Volta).
MIN_COMPUTE_CAPABILITY = 7

NO_KERNEL = (
    "ds-ops ships no Evoformer attention kernel (DeepSpeed builds it from its own "
    "csrc/deepspeed4science/evoformer_attn CUDA sources, which ds does not include), so there is nothing to build"
)


class EvoformerAttnBuilder(CUDAOpBuilder):
    """The `evoformer_attn` op: CUTLASS discovery, target filtering and flags as DeepSpeed's; never loadable in ds.

    Attributes:
        cutlass_path: $CUTLASS_PATH when the builder was made (None when unset).
    """

    NAME = "evoformer_attn"
    INCLUDE_DIRS = ()
    CUTLASS_IGNORE = "DS_IGNORE_CUTLASS_DETECTION"
    CUTLASS_PYTHON_BINDINGS = "DS_USE_CUTLASS_PYTHON_BINDINGS"

    def __init__(self) -> None:
        super().__init__()
        self.cutlass_path: str | None = os.environ.get("CUTLASS_PATH") or None
        self._resolved_cutlass_path: Path | None = None

    def absolute_name(self) -> str:
        return f"ds_ops.{self.NAME}_op"

    # ---- CUTLASS --------------------------------------------------------------------------------
    @staticmethod
    def _python_package_cutlass_paths() -> list[Path]:
        """Where the `nvidia-cutlass` package keeps CUTLASS (empty when it is not installed)."""
        return _cutlass.python_package_roots()

    def _candidate_cutlass_paths(self) -> list[Path]:
        """The folders `include_paths` tries, in order.

        Raises:
            ImportError: CUTLASS_PATH asks for the `nvidia-cutlass` package and it is not installed.
        """
        if self.cutlass_path == self.CUTLASS_PYTHON_BINDINGS:
            roots = self._python_package_cutlass_paths()
            if not roots:
                raise ImportError(
                    f"Unable to locate CUTLASS: CUTLASS_PATH={self.CUTLASS_PYTHON_BINDINGS} asks for the "
                    "nvidia-cutlass Python package, which is not installed (pip install nvidia-cutlass)"
                )
            return roots
        if self.cutlass_path:
            return [Path(self.cutlass_path)]
        return _cutlass.search_roots(os.environ, self._python_package_cutlass_paths())

    def include_paths(self) -> list[str]:
        """CUTLASS's include folders: `<cutlass>/include`, then `<cutlass>/tools/util/include` when present.

        Empty when CUTLASS_PATH is `DS_IGNORE_CUTLASS_DETECTION`.

        Raises:
            RuntimeError: no candidate holds CUTLASS's headers (the message lists where it looked and how
                to provide CUTLASS), or CUTLASS_PATH points somewhere without them.
            ImportError: see `_candidate_cutlass_paths`.
        """
        if self.cutlass_path == self.CUTLASS_IGNORE:
            return []
        candidates = self._candidate_cutlass_paths()
        for candidate in candidates:
            found = _cutlass.include_dirs(candidate)
            if found:
                self._resolved_cutlass_path = candidate.expanduser().resolve()
                return found
        if self.cutlass_path and self.cutlass_path != self.CUTLASS_PYTHON_BINDINGS:
            raise RuntimeError(
                f"Unable to locate CUTLASS: CUTLASS_PATH={self.cutlass_path} holds neither include/cutlass/cutlass.h "
                "nor cutlass/cutlass.h"
            )
        searched = ", ".join(str(path) for path in candidates)
        raise RuntimeError(
            f"Unable to locate CUTLASS (searched {searched}): pip install nvidia-cutlass, clone "
            "https://github.com/NVIDIA/cutlass into ./cutlass, or set CUTLASS_PATH to a CUTLASS checkout"
        )

    def cutlass_problems(self) -> list[str]:
        """Why the CUTLASS found (or not found) here would not do; empty when it would or detection is off."""
        if self.cutlass_path == self.CUTLASS_IGNORE:
            return []
        try:
            folders = self.include_paths()
        except (RuntimeError, ImportError) as err:
            return [str(err)]
        version = _cutlass.header_version(Path(folders[0]))
        if version is not None and version < MIN_CUTLASS_VERSION:
            return [
                f"CUTLASS at {self._resolved_cutlass_path} is {'.'.join(map(str, version))}; Evoformer attention "
                f"needs {'.'.join(map(str, MIN_CUTLASS_VERSION))} or newer"
            ]
        return []

    # ---- flags ----------------------------------------------------------------------------------
    def filter_ccs(self, ccs: list[str]) -> list[list[str]]:
        """Keep the targets with Tensor Cores (compute capability 7.0 and up), `+PTX` suffixes intact."""
        kept: list[list[str]] = []
        dropped: list[list[str]] = []
        for parts in (cc.split(".") for cc in ccs):
            (kept if int(parts[0]) >= MIN_COMPUTE_CAPABILITY else dropped).append(parts)
        if dropped:
            self.warning(
                f"Evoformer: excluding targets below SM {MIN_COMPUTE_CAPABILITY}.0: {dropped}. Tensor Core required."
            )
        return kept

    def nvcc_args(self) -> list[str]:
        """The CUDA flags; `$DS_EVOFORMER_GPU_ARCH` is no longer honoured (a warning says so)."""
        if os.environ.get("DS_EVOFORMER_GPU_ARCH"):
            self.warning(
                "DS_EVOFORMER_GPU_ARCH is deprecated and ignored for Evoformer builds. "
                "Use TORCH_CUDA_ARCH_LIST to control build targets."
            )
        return super().nvcc_args()

    def extra_ldflags(self) -> list[str]:
        return [*super().extra_ldflags(), "-lcurand"]  # the kernels draw their dropout masks with cuRAND

    # ---- compatibility and loading ----------------------------------------------------------------
    def runtime_problems(self) -> list[str]:
        import torch  # noqa: PLC0415 - asked only when the op is about to be used

        problems = [NO_KERNEL, *super().runtime_problems()]
        cuda = torch.version.cuda
        if cuda is not None and int(cuda.split(".")[0]) < 11:
            problems.append(f"Evoformer attention needs CUDA 11 or newer; torch is built with CUDA {cuda}")
        # Reading a capability creates a CUDA context; only ask when one exists already (a compatibility
        # check must not break fork-based workers started after it).
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            major, minor = torch.cuda.get_device_capability(0)
            if major < MIN_COMPUTE_CAPABILITY:
                problems.append(
                    f"Evoformer attention needs compute capability {MIN_COMPUTE_CAPABILITY}.0 or newer; device 0 "
                    f"is {major}.{minor}"
                )
        return problems

    def build_problems(self) -> list[str]:
        """The missing kernel and CUTLASS's problems; no compiler is probed, since nothing would be compiled."""
        problems = [NO_KERNEL, *self.cutlass_problems()]
        if self.nvcc_command() is None:
            problems.append("nvcc not found (set $CUDA_HOME or put the CUDA toolkit's bin on PATH)")
        return problems

    def compatibility_notes(self) -> list[str]:
        if self.cutlass_path == self.CUTLASS_IGNORE:
            return [f"CUTLASS detection is off (CUTLASS_PATH={self.CUTLASS_IGNORE})"]
        try:
            folders = self.include_paths()
        except (RuntimeError, ImportError) as err:
            return [str(err)]
        version = _cutlass.header_version(Path(folders[0]))
        shown = ".".join(map(str, version)) if version else "version unknown"
        return [f"CUTLASS {shown} at {self._resolved_cutlass_path}"]

    def prebuilt_installed(self) -> bool:
        return False

    def load(self, verbose: bool = True) -> ctypes.CDLL:
        """Never returns: ds has no Evoformer kernel.

        Raises:
            OpNotCompatibleError: always; the message names the missing kernel and every other problem
                this host has (CUDA, CUTLASS).
        """
        reasons = list(dict.fromkeys([*self.runtime_problems(), *self.build_problems()]))
        raise OpNotCompatibleError(f"op {self.name} cannot be loaded: {'; '.join(reasons)}")
