"""`OpBuilder`: what an op compiles from, whether it can build and run here, and how it is loaded.

[Note: why ctypes] DeepSpeed builds each op as a torch C++ extension, which includes torch's headers
(about 90 s cold for cpu_adam on a small host, and 2.3 s to load from cache because torch's
extension loader runs ninja again). Our kernels work on raw pointers, so an op is a plain shared
library: ninja compiles it from a build.ninja we write (a couple of seconds), and `ctypes` loads it
(milliseconds; the cached path spawns no process and never imports `torch.utils.cpp_extension`).
Calls release the GIL. The library also does not depend on the Python or torch ABI.

load() order: the library prebuilt into the wheel (AOT) if this host can run it; else the JIT
cache `<extensions_root>/<op>_<key>/<op>.so`; else a build under a file lock, so that concurrent
ranks on one host build once and the others wait and load. The key covers the op name, the op ABI,
torch's version, the machine, the compiler command, every flag (the SIMD level included) and the
hash of the sources and headers.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ds_ops.op_builder._cache import cache_key, extensions_root, file_lock, hash_files, torch_version
from ds_ops.op_builder._ninja import NinjaSpec, OpBuildError, render, run_ninja
from ds_ops.op_builder._prebuilt import prebuilt_entry, usable_prebuilt
from ds_ops.op_builder._toolchain import (
    PROBE_SOURCE,
    SIMD_FLAGS,
    cxx_command,
    detect_simd,
    find_cxx,
    find_ninja,
    probe_compiler,
)

logger = logging.getLogger(__name__)

# Must equal ds::kAbiVersion in csrc/includes/ds_cpu_optim.h (and the CUDA sources).
ABI_VERSION = 2
CSRC_ROOT = Path(__file__).resolve().parent.parent / "csrc"

# Loaded libraries by path: a second load() in the process costs a dict lookup and binding its functions.
_LIBRARIES: dict[Path, ctypes.CDLL] = {}

CFunctionSpec = tuple[Any, tuple[Any, ...]]


class OpNotCompatibleError(RuntimeError):
    """The op cannot be built or run on this machine; the message lists every reason."""


@dataclass(frozen=True)
class Compatibility:
    """The answer of `OpBuilder.is_compatible`: truthy when compatible, else the reasons why not.

    Attributes:
        op_name: the op.
        reasons: one sentence per problem (empty when compatible).
        notes: facts worth showing either way (which kernel interface the op uses, which optional
            library is missing and which package provides it).
    """

    op_name: str
    reasons: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return not self.reasons

    def __str__(self) -> str:
        text = "compatible" if not self.reasons else "; ".join(self.reasons)
        return f"{text} ({'; '.join(self.notes)})" if self.notes else text


class OpBuilder:
    """Base of every op builder: sources, flags, compatibility, JIT/AOT build and load.

    A subclass sets `NAME`, `SOURCES` (relative to `csrc_root()`) and `FUNCTIONS` (the exported C
    functions with their ctypes result and argument types), and may override any method below.
    """

    NAME: ClassVar[str] = ""
    SOURCES: ClassVar[tuple[str, ...]] = ()
    INCLUDE_DIRS: ClassVar[tuple[str, ...]] = ("includes",)
    FUNCTIONS: ClassVar[dict[str, CFunctionSpec]] = {}

    def __init__(self) -> None:
        if not self.NAME:
            raise TypeError(f"{type(self).__name__} must set NAME")
        self.name: str = self.NAME
        self.loaded_from: str | None = None
        """How the last load() found the library: "prebuilt", "cache" or "jit" (None before)."""

    # ---- what is compiled -------------------------------------------------------------------
    def absolute_name(self) -> str:
        """A dotted name for the op (DeepSpeed's builders have one; used in messages)."""
        return f"ds_ops.{self.name}_op"

    def csrc_root(self) -> Path:
        """The folder `SOURCES` and `INCLUDE_DIRS` are relative to."""
        return CSRC_ROOT

    def sources(self) -> list[Path]:
        """Absolute paths of the sources."""
        return [self.csrc_root() / src for src in self.SOURCES]

    def include_paths(self) -> Sequence[Path | str]:
        """Absolute include folders."""
        return [self.csrc_root() / inc for inc in self.INCLUDE_DIRS]

    def simd_level(self) -> str:
        """The SIMD level compiled for: the best this CPU runs."""
        return detect_simd()

    def cxx_args(self) -> list[str]:
        """C++ flags: -O3, OpenMP, the SIMD flags, and no FMA contraction (see ds_cpu_optim.h)."""
        level = self.simd_level()
        return [
            "-O3",
            "-std=c++17",
            "-fPIC",
            "-fopenmp",
            "-fno-math-errno",
            "-ffp-contract=off",
            "-fvisibility=hidden",
            *SIMD_FLAGS[level],
            f'-DDS_SIMD_LEVEL="{level}"',
            *(f"-I{path}" for path in self.include_paths()),
        ]

    def extra_ldflags(self) -> list[str]:
        """Link flags."""
        return ["-shared", "-fopenmp"]

    def nvcc_args(self) -> list[str]:
        """nvcc flags (CUDA ops only)."""
        return []

    def nvcc_command(self) -> str | None:
        """The nvcc to compile .cu sources with (CUDA ops only)."""
        return None

    # ---- compatibility ----------------------------------------------------------------------
    def build_problems(self) -> list[str]:
        """Why the op cannot be compiled here (empty when it can). Runs the compiler once per process."""
        problems = []
        if os.name != "posix":
            problems.append(f"JIT/AOT builds need a POSIX host (this is {platform.system()})")
        compiler = find_cxx()
        if compiler is None:
            problems.append(f"C++ compiler {cxx_command()!r} not found (set $CXX or install g++/clang++)")
        if find_ninja() is None:
            problems.append("ninja not found (pip install ninja)")
        if compiler is not None:
            problems += self.flag_problems(compiler)
        return problems

    def flag_problems(self, compiler: str) -> list[str]:
        """Compile and link a probe with this op's flags (SIMD, OpenMP); the compiler's message if it fails."""
        flags = tuple(flag for flag in self.cxx_args() if not flag.startswith(("-I", "-D")))
        ok, message = probe_compiler(compiler, flags, tuple(self.extra_ldflags()), PROBE_SOURCE)
        return [] if ok else [f"the compiler rejects this op's flags or cannot link OpenMP: {message}"]

    def runtime_problems(self) -> list[str]:
        """Why the op, even compiled, cannot run here (empty for CPU ops)."""
        return []

    def compatibility_notes(self) -> list[str]:
        """What `is_compatible` reports besides problems (e.g. which kernel interface is used); none by default."""
        return []

    def warning(self, message: str) -> None:
        """Log `message` about this op at WARNING (DeepSpeed's builders report through this method)."""
        logger.warning("op %s: %s", self.name, message)

    def can_build(self) -> Compatibility:
        """Whether the op compiles here (what the AOT build hook asks)."""
        return Compatibility(self.name, tuple(self.build_problems()))

    def is_compatible(self, verbose: bool = False) -> Compatibility:
        """Whether the op can be built and run here; falsy with the reasons when not.

        When the op cannot run here (a CUDA op without a device) the build is not probed: that
        reason is enough, and `can_build()` answers the build question alone.

        Args:
            verbose: also log each reason at WARNING, and each note at INFO.
        """
        problems = self.runtime_problems() or self.build_problems()
        result = Compatibility(self.name, tuple(problems), tuple(self.compatibility_notes()))
        if verbose:
            for reason in result.reasons:
                logger.warning("op %s is not compatible: %s", self.name, reason)
            for note in result.notes:
                logger.info("op %s: %s", self.name, note)
        return result

    # ---- building -------------------------------------------------------------------------------
    def cache_parts(self) -> list[str]:
        """What the JIT cache key covers."""
        folders = [Path(inc) for inc in self.include_paths()]
        headers = sorted(p for inc in folders if inc.is_dir() for p in inc.rglob("*") if p.is_file())
        return [
            f"op={self.name}",
            f"abi={ABI_VERSION}",
            f"torch={torch_version()}",
            f"machine={platform.machine()}",
            f"cxx={cxx_command()}",
            f"cxx_flags={' '.join(self.cxx_args())}",
            f"ldflags={' '.join(self.extra_ldflags())}",
            f"nvcc={self.nvcc_command()}",
            f"nvcc_flags={' '.join(self.nvcc_args())}",
            f"sources={hash_files([*self.sources(), *headers])}",
        ]

    def cache_dir(self) -> Path:
        """This op's JIT build folder (one per cache key)."""
        return extensions_root() / f"{self.name}_{cache_key(self.cache_parts())}"

    def build(self, build_dir: Path, output_name: str | None = None) -> Path:
        """Compile the op into `build_dir` with ninja and return the library's path.

        Raises:
            OpBuildError: the compiler failed; the message holds its output.
        """
        ninja = find_ninja()
        if ninja is None:
            raise OpNotCompatibleError(f"op {self.name}: ninja not found (pip install ninja)")
        spec = NinjaSpec(
            sources=tuple(self.sources()),
            output=output_name or f"{self.name}.so",
            cxx=find_cxx() or cxx_command(),
            cxx_flags=tuple(self.cxx_args()),
            ldflags=tuple(self.extra_ldflags()),
            nvcc=self.nvcc_command(),
            nvcc_flags=tuple(self.nvcc_args()),
        )
        build_dir.mkdir(parents=True, exist_ok=True)
        (build_dir / "build.ninja").write_text(render(spec))
        run_ninja(ninja, build_dir, op_name=self.name)
        return build_dir / spec.output

    def _jit_build(self, library: Path, verbose: bool) -> str:
        """Build `library` unless another process did while we waited for the lock; returns the source."""
        with file_lock(library.parent.with_suffix(".lock"), what=f"building op {self.name}"):
            if library.exists():
                return "cache"
            compatibility = self.can_build()
            if not compatibility:
                raise OpNotCompatibleError(f"op {self.name} cannot be built on this machine: {compatibility}")
            level = logging.INFO if verbose else logging.DEBUG
            logger.log(
                level, "compiling op %s (%s; first use, cached in %s)...", self.name, self.simd_level(), library.parent
            )
            started = time.perf_counter()
            built = self.build(library.parent, output_name=f"{self.name}.partial.so")
            os.replace(built, library)  # readers that skip the lock never see a half-written library
            logger.log(level, "compiled op %s in %.1f s", self.name, time.perf_counter() - started)
        return "jit"

    # ---- loading --------------------------------------------------------------------------------
    def _open(self, path: Path) -> ctypes.CDLL:
        """The library at `path` (opened and ABI-checked once per process), checked to export this op's functions.

        The check runs on every call: two builders can meet at one path (a prebuilt library of
        another flavour of the op), and one that lacks a function must fail as OSError, so that
        load() builds the right library instead.
        """
        library = _LIBRARIES.get(path)
        if library is None:
            library = ctypes.CDLL(str(path))
            self._bind(
                library, path, {"ds_op_abi_version": (ctypes.c_int32, ()), "ds_op_simd_level": (ctypes.c_char_p, ())}
            )
            abi = library.ds_op_abi_version()
            if abi != ABI_VERSION:
                raise OSError(f"{path} has op ABI {abi}, this ds-ops needs {ABI_VERSION}")
            _LIBRARIES[path] = library
        self._bind(library, path, self.FUNCTIONS)
        return library

    def _bind(self, library: ctypes.CDLL, path: Path, functions: dict[str, CFunctionSpec]) -> None:
        for name, (restype, argtypes) in functions.items():
            try:
                function = getattr(library, name)
            except AttributeError:
                raise OSError(f"{path} does not export {name}: it is not op {self.name}'s library") from None
            function.restype = restype
            function.argtypes = list(argtypes)

    def prebuilt_installed(self) -> bool:
        """Whether the wheel holds a prebuilt library of this op (usable on this host or not)."""
        return prebuilt_entry(self.name) is not None

    def prebuilt_library(self) -> tuple[Path | None, str]:
        """(the wheel's prebuilt library of this op, usable here) or (None, why not)."""
        return usable_prebuilt(self.name, ABI_VERSION)

    def load(self, verbose: bool = True) -> ctypes.CDLL:
        """The op's library, ready to call: prebuilt, else cached, else JIT-built (see module note).

        Args:
            verbose: log the one-line "compiling op ..." message and its duration at INFO (else DEBUG).

        Raises:
            OpNotCompatibleError: the op cannot run or cannot be built here; the message gives the reasons.
            OpBuildError: the compiler failed; the message holds the compiler's output.
        """
        runtime = self.runtime_problems()
        if runtime:
            raise OpNotCompatibleError(f"op {self.name} cannot run on this machine: {'; '.join(runtime)}")
        prebuilt, why_not = self.prebuilt_library()
        if prebuilt is not None:
            try:
                library = self._open(prebuilt)
            except OSError as err:
                logger.warning("prebuilt op %s does not load (%s); building it", self.name, err)
            else:
                self.loaded_from = "prebuilt"
                return library
        else:
            logger.debug("op %s: no usable prebuilt library (%s)", self.name, why_not)
        library_path = self.cache_dir() / f"{self.name}.so"
        source = "cache"
        try:
            if not library_path.exists():
                source = self._jit_build(library_path, verbose)
        except (OpBuildError, OpNotCompatibleError) as err:
            raise err.with_traceback(None) from None  # the compiler's text is the story, not our frames
        library = self._open(library_path)
        self.loaded_from = source
        return library

    def jit_load(self, verbose: bool = True) -> ctypes.CDLL:
        """DeepSpeed's name for a JIT load; same as `load()`."""
        return self.load(verbose=verbose)
