"""Write a build.ninja for an op library and run ninja on it; a failure carries the compiler's text."""

from __future__ import annotations

import logging
import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

# The tail of the compiler output kept in an exception message (the whole of it goes to build.log).
MAX_MESSAGE_CHARS = 12000


class OpBuildError(RuntimeError):
    """Compiling an op failed; the message holds the op name, the failing command and the compiler's output."""


@dataclass(frozen=True)
class NinjaSpec:
    """Everything a build.ninja for one shared library needs.

    Attributes:
        sources: absolute paths of .cpp/.c and .cu files.
        output: file name of the library inside the build folder.
        cxx: the C++ compiler command.
        cxx_flags: flags for every C/C++ compile.
        ldflags: flags for the link (the library is linked with nvcc when there is a .cu source).
        nvcc: the nvcc command, or None when there is no .cu source.
        nvcc_flags: flags for every .cu compile.
    """

    sources: tuple[Path, ...]
    output: str
    cxx: str
    cxx_flags: tuple[str, ...]
    ldflags: tuple[str, ...]
    nvcc: str | None = None
    nvcc_flags: tuple[str, ...] = ()


def _escape(path: Path | str) -> str:
    return str(path).replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def render(spec: NinjaSpec) -> str:
    """The build.ninja text: one object per source (header dependencies through depfiles), one link."""
    join = shlex.join
    lines = [
        "ninja_required_version = 1.3",
        f"cxx = {shlex.quote(spec.cxx)}",
        f"cxx_flags = {join(spec.cxx_flags)}",
        f"ldflags = {join(spec.ldflags)}",
        "",
        "rule cxx",
        "  command = $cxx -MMD -MF $out.d $cxx_flags -c $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "  description = compiling $in",
        "",
    ]
    has_cuda = any(src.suffix == ".cu" for src in spec.sources)
    if has_cuda:
        if spec.nvcc is None:
            raise ValueError("a .cu source needs nvcc")
        lines += [
            f"nvcc = {shlex.quote(spec.nvcc)}",
            f"nvcc_flags = {join(spec.nvcc_flags)}",
            "rule nvcc",
            "  command = $nvcc -MD -MF $out.d $nvcc_flags -c $in -o $out",
            "  depfile = $out.d",
            "  deps = gcc",
            "  description = compiling $in",
            "",
        ]
    linker = "$nvcc" if has_cuda else "$cxx"
    lines += ["rule link", f"  command = {linker} $in $ldflags -o $out", "  description = linking $out", ""]
    objects = []
    for index, src in enumerate(spec.sources):
        obj = f"{index}_{re.sub(r'[^A-Za-z0-9_.-]', '_', src.stem)}.o"  # a plain name ninja needs no escape for
        objects.append(obj)
        lines.append(f"build {obj}: {'nvcc' if src.suffix == '.cu' else 'cxx'} {_escape(src)}")
    lines += [f"build {spec.output}: link {' '.join(objects)}", f"default {spec.output}", ""]
    return "\n".join(lines)


def run_ninja(ninja: str, build_dir: Path, *, op_name: str, num_jobs: int | None = None) -> None:
    """Run ninja in `build_dir`; raise `OpBuildError` with the compiler's output when it fails.

    The output is also written to `build_dir/build.log`. `num_jobs` defaults to $MAX_JOBS (the
    variable torch's extension builder reads), else ninja's own default.
    """
    cmd = [ninja, "-C", str(build_dir)]
    jobs = num_jobs or (int(os.environ["MAX_JOBS"]) if os.environ.get("MAX_JOBS", "").isdigit() else None)
    if jobs:
        cmd += ["-j", str(jobs)]
    result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    (build_dir / "build.log").write_text(result.stdout)
    if result.returncode != 0:
        output = result.stdout.strip()
        if len(output) > MAX_MESSAGE_CHARS:
            output = "...\n" + output[-MAX_MESSAGE_CHARS:]
        raise OpBuildError(f"compiling op {op_name!r} failed (full log: {build_dir / 'build.log'}):\n{output}")
    logger.debug("ninja output for %s:\n%s", op_name, result.stdout)
