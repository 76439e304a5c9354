"""The build toolchain: this CPU's SIMD level, the C++ compiler, ninja, nvcc, and compiler probes.

Nothing here imports torch, so the AOT build hook can use it in a build environment without torch.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

# Compiler flags per SIMD level. NEON is baseline on aarch64, so it needs no flag; F16C comes with
# every AVX2 CPU and gives the vector fp16 conversions.
SIMD_FLAGS: dict[str, tuple[str, ...]] = {
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma", "-mf16c"),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "neon": (),
    "none": (),
}
# Which compiled levels a CPU of a given level can run.
_RUNNABLE: dict[str, frozenset[str]] = {
    "avx512": frozenset({"avx512", "avx2", "none"}),
    "avx2": frozenset({"avx2", "none"}),
    "neon": frozenset({"neon", "none"}),
    "none": frozenset({"none"}),
}
_AVX512_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx2", "fma", "f16c"})
_AVX2_FLAGS = frozenset({"avx2", "fma", "f16c"})

# Compiled and linked by `probe_compiler`: the op's flags must be accepted and OpenMP must link.
PROBE_SOURCE = """#include <omp.h>
extern "C" int ds_probe(void) { int n = 0;
#pragma omp parallel reduction(+:n)
  n += 1;
  return n; }
"""


def simd_from_cpuinfo(text: str, machine: str) -> str:
    """The SIMD level from the text of /proc/cpuinfo ("flags" on x86, "Features" on arm)."""
    if machine.lower() in ("aarch64", "arm64"):
        return "neon"  # Advanced SIMD is mandatory in ARMv8-A
    match = re.search(r"^flags\s*:(.*)$", text, re.M)
    flags = set(match.group(1).split()) if match else set()
    if _AVX512_FLAGS <= flags:
        return "avx512"
    if _AVX2_FLAGS <= flags:
        return "avx2"
    return "none"


def simd_from_macros(text: str) -> str:
    """The SIMD level from `cc -march=native -dM -E` output (the fallback off Linux)."""
    macros = set(re.findall(r"#define (\w+)", text))
    if {"__AVX512F__", "__AVX512BW__", "__AVX512VL__", "__AVX2__", "__FMA__", "__F16C__"} <= macros:
        return "avx512"
    if {"__AVX2__", "__FMA__", "__F16C__"} <= macros:
        return "avx2"
    if "__ARM_NEON" in macros:
        return "neon"
    return "none"


@functools.lru_cache(maxsize=1)
def detect_simd() -> str:
    """The best SIMD level this CPU runs: "avx512", "avx2", "neon" or "none".

    Read from /proc/cpuinfo (no process spawned, so cached loads stay fast); elsewhere from the
    compiler's `-march=native` macros.
    """
    machine = platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        return simd_from_cpuinfo(cpuinfo.read_text(errors="replace"), machine)
    if machine.lower() in ("aarch64", "arm64"):
        return "neon"
    compiler = find_cxx()
    if compiler is None:
        return "none"
    result = subprocess.run(
        [compiler, "-march=native", "-dM", "-E", "-x", "c++", os.devnull], capture_output=True, text=True, check=False
    )
    return simd_from_macros(result.stdout) if result.returncode == 0 else "none"


def can_run(compiled_level: str, cpu_level: str) -> bool:
    """Whether code compiled for `compiled_level` runs on a CPU whose best level is `cpu_level`."""
    return compiled_level in _RUNNABLE.get(cpu_level, frozenset({"none"}))


def cxx_command() -> str:
    """The C++ compiler command: $CXX, else `c++`."""
    return os.environ.get("CXX") or "c++"


def find_cxx() -> str | None:
    """Absolute path of the C++ compiler, or None when it is not installed."""
    return shutil.which(cxx_command())


def find_ninja() -> str | None:
    """Absolute path of ninja: the `ninja` wheel's binary (a declared dependency), else PATH."""
    try:
        import ninja  # noqa: PLC0415 - optional at import time; only building needs it
    except ImportError:
        bundled = None
    else:
        candidate = Path(ninja.BIN_DIR) / "ninja"
        bundled = str(candidate) if candidate.exists() else None
    return bundled or shutil.which("ninja")


def cuda_home() -> Path | None:
    """$CUDA_HOME / $CUDA_PATH, else the folder above the nvcc on PATH, else /usr/local/cuda."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return Path(os.environ[var])
    nvcc = shutil.which("nvcc")
    if nvcc:
        return Path(nvcc).resolve().parent.parent
    default = Path("/usr/local/cuda")
    return default if default.exists() else None


def find_nvcc() -> str | None:
    """Absolute path of nvcc, or None."""
    home = cuda_home()
    if home is not None and (home / "bin" / "nvcc").exists():
        return str(home / "bin" / "nvcc")
    return shutil.which("nvcc")


def tool_version(path: str | None, flag: str = "--version") -> str:
    """The first informative line of `path --version` (ds_report); "" when it cannot be run."""
    if path is None:
        return ""
    try:
        result = subprocess.run([path, flag], capture_output=True, text=True, timeout=30, check=False)
    except OSError:
        return ""
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    release = [line for line in lines if "release" in line]  # nvcc puts its version on a later line
    return (release or lines or [""])[0].strip()


@functools.lru_cache(maxsize=32)
def probe_compiler(
    compiler: str, flags: tuple[str, ...], ldflags: tuple[str, ...], source: str, suffix: str = ".cpp"
) -> tuple[bool, str]:
    """Compile and link `source` with `flags`; returns (ok, the compiler's message when not ok).

    Cached per process: `is_compatible` answers from memory after the first call.
    """
    with tempfile.TemporaryDirectory(prefix="ds_ops_probe_") as tmp:
        src = Path(tmp) / f"probe{suffix}"
        src.write_text(source)
        cmd = [compiler, *flags, str(src), *ldflags, "-o", str(Path(tmp) / "probe.so")]
        try:
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        except (OSError, subprocess.TimeoutExpired) as err:
            return False, f"{' '.join(cmd)}: {err}"
    if result.returncode != 0:
        message = (result.stderr or result.stdout).strip()
        return False, f"`{' '.join(cmd)}` failed:\n{message}"
    return True, ""
