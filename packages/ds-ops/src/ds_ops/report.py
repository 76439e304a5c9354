"""`ds_report` (and `python -m ds_ops.report`): what ds-ops finds on this machine and which ops work.

Prints torch's version and CUDA version, the accelerator, ninja, the C++ compiler, nvcc, the CPU's
SIMD level, the JIT cache folder, and for each op whether it is installed (prebuilt in the wheel),
already in the JIT cache, and compatible here, with the reasons when it is not and the op's notes
(e.g. which kernel interface async_io uses). Finding compatibility runs each op's compiler probe once.
"""

from __future__ import annotations

import argparse
import logging
import platform
import sys
from collections.abc import Sequence

import torch

from ds_comm import get_accelerator
from ds_ops.__about__ import __version__
from ds_ops.op_builder import SIMD_FLAGS, detect_simd, extensions_root, host_op_builders
from ds_ops.op_builder._toolchain import find_cxx, find_ninja, find_nvcc, tool_version

logger = logging.getLogger(__name__)

WIDTH = 72


def _line(name: str, value: str) -> str:
    return f"{name} {'.' * max(2, 26 - len(name))} {value}"


def environment_lines() -> list[str]:
    """The environment section: versions, tools and the SIMD level."""
    accelerator = get_accelerator()
    ninja = find_ninja()
    cxx = find_cxx()
    nvcc = find_nvcc()
    simd = detect_simd()
    return [
        _line("ds-ops version", __version__),
        _line("python", f"{platform.python_version()} ({sys.executable})"),
        _line("torch version", str(torch.__version__)),
        _line("torch CUDA version", str(torch.version.cuda)),
        _line(
            "accelerator",
            f"{accelerator.device_name()} (communication backend {accelerator.communication_backend_name()})",
        ),
        _line("ninja", f"{tool_version(ninja)} ({ninja})" if ninja else "NOT FOUND (pip install ninja)"),
        _line("C++ compiler", f"{tool_version(cxx)} ({cxx})" if cxx else "NOT FOUND (install g++ or set $CXX)"),
        _line("nvcc", f"{tool_version(nvcc)} ({nvcc})" if nvcc else "not found (needed for CUDA ops only)"),
        _line("SIMD level", f"{simd} ({' '.join(SIMD_FLAGS[simd]) or 'no extra flags'})"),
        _line("JIT cache", str(extensions_root())),
    ]


def op_lines(show_errors: bool = True) -> list[str]:
    """One row per op: installed (prebuilt), cached (JIT-built already), compatible; then the reasons and notes."""
    rows = [f"{'op name':<16}{'installed':<12}{'cached':<10}{'compatible':<12}", "-" * WIDTH]
    notes = []
    facts = []
    for name, builder_class in host_op_builders().items():  # fused_adam: the accelerator's implementation
        builder = builder_class()
        installed = builder.prebuilt_installed()
        try:
            cached = (builder.cache_dir() / f"{name}.so").exists()
        except (OSError, ValueError) as err:  # e.g. a malformed TORCH_CUDA_ARCH_LIST
            cached = False
            notes.append(f"{name}: {err}")
        compatibility = builder.is_compatible()
        rows.append(
            f"{name:<16}{'[YES]' if installed else '[NO]':<12}{'[YES]' if cached else '[NO]':<10}"
            f"{'[OKAY]' if compatibility else '[NO]':<12}".rstrip()
        )
        notes += [f"{name}: {reason}" for reason in compatibility.reasons]
        facts += [f"{name}: {note}" for note in compatibility.notes]
    if show_errors and notes:
        rows += ["", "why not compatible:", *(f"  {note}" for note in notes)]
    if facts:
        rows += ["", "op notes:", *(f"  {fact}" for fact in facts)]
    return rows


def render(show_ops: bool = True, show_errors: bool = True) -> str:
    """The whole report as text."""
    lines = ["-" * WIDTH, "ds-ops report", "-" * WIDTH, *environment_lines()]
    if show_ops:
        lines += ["-" * WIDTH, *op_lines(show_errors)]
    return "\n".join([*lines, "-" * WIDTH]) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `ds_report`."""
    parser = argparse.ArgumentParser(prog="ds_report", description=__doc__.splitlines()[0])
    parser.add_argument("--hide_operator_status", action="store_true", help="skip the per-op table")
    parser.add_argument(
        "--hide_errors_and_warnings", action="store_true", help="skip the reasons an op is not compatible"
    )
    args = parser.parse_args(argv)
    sys.stdout.write(render(show_ops=not args.hide_operator_status, show_errors=not args.hide_errors_and_warnings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
