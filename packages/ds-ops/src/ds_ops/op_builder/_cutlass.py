"""Finding CUTLASS's headers: where a header-only CUDA template library may have been put on this host.

CUTLASS ships no pkg-config file and no single install layout: people clone it, pip-install it
(`nvidia-cutlass`, whose `cutlass_library` package carries the sources), or install it into a conda,
CMake or system prefix. A folder counts as CUTLASS when it holds `include/cutlass/cutlass.h` (a
checkout or an install prefix) or `cutlass/cutlass.h` (an include folder itself). The checkout's
`tools/util/include` (host-side helpers) is added when present.

Nothing here imports torch.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

#: Variables naming install prefixes a CUTLASS may live under (each may hold several, os.pathsep-separated).
PREFIX_VARIABLES = (
    "CUTLASS_ROOT",
    "CUTLASS_HOME",
    "CONDA_PREFIX",
    "VIRTUAL_ENV",
    "CMAKE_PREFIX_PATH",
    "CUDA_HOME",
    "CUDA_PATH",
)
#: The compiler's include-path variables: their entries are include folders, not prefixes.
INCLUDE_VARIABLES = ("CPATH", "CPLUS_INCLUDE_PATH", "C_INCLUDE_PATH")
#: Where people put CUTLASS by hand, after every variable has been tried.
CONVENTIONAL_PATHS = (Path("/usr/local/cutlass"), Path("/opt/cutlass"), Path("/usr/local"), Path("/usr"))

_VERSION_DEFINE = re.compile(r"^\s*#\s*define\s+CUTLASS_(MAJOR|MINOR|PATCH)\s+(\d+)", re.MULTILINE)


def dedupe_paths(paths: Iterable[Path | str]) -> list[Path]:
    """`paths` with `~` expanded, each kept once, in first-seen order."""
    seen: set[str] = set()
    result = []
    for path in paths:
        expanded = Path(path).expanduser()
        if str(expanded) not in seen:
            seen.add(str(expanded))
            result.append(expanded)
    return result


def env_paths(environ: Mapping[str, str], names: Iterable[str]) -> list[Path]:
    """The non-empty entries of the path-list variables `names`, in order."""
    paths = []
    for name in names:
        paths += [Path(entry) for entry in environ.get(name, "").split(os.pathsep) if entry]
    return paths


def python_package_roots() -> list[Path]:
    """The folders the `nvidia-cutlass` package (import name `cutlass_library`) may keep CUTLASS's sources in.

    Empty when the package is not installed.
    """
    try:
        package = importlib.import_module("cutlass_library")
    except ImportError:
        return []
    roots = []
    source_path = getattr(package, "source_path", None)
    if source_path:
        roots.append(Path(source_path))
    package_file = getattr(package, "__file__", None)
    if package_file:
        package_dir = Path(package_file).resolve().parent
        roots += [package_dir / "source", package_dir.parent, package_dir]
    return roots


def search_roots(environ: Mapping[str, str], package_roots: Iterable[Path]) -> list[Path]:
    """Where to look when no CUTLASS_PATH is given, most specific first.

    The pip package, the prefix variables (`PREFIX_VARIABLES`), this Python's prefixes, the
    compiler's include variables (`INCLUDE_VARIABLES`), `./cutlass` (a clone next to the training
    script), then `CONVENTIONAL_PATHS`.
    """
    return dedupe_paths(
        [
            *package_roots,
            *env_paths(environ, PREFIX_VARIABLES),
            Path(sys.prefix),
            Path(sys.exec_prefix),
            Path(sys.base_prefix),
            *env_paths(environ, INCLUDE_VARIABLES),
            Path.cwd() / "cutlass",
            *CONVENTIONAL_PATHS,
        ]
    )


def include_dirs(root: Path) -> list[str]:
    """The include folders CUTLASS at `root` contributes (absolute), or [] when `root` holds no CUTLASS.

    `root` may be a checkout or install prefix (`root/include/cutlass/cutlass.h`) or the include
    folder itself (`root/cutlass/cutlass.h`); the checkout's `tools/util/include` follows when it exists.
    """
    root = root.expanduser().resolve()
    if (root / "include" / "cutlass" / "cutlass.h").is_file():
        include_root, checkout = root / "include", root
    elif (root / "cutlass" / "cutlass.h").is_file():
        include_root, checkout = root, root.parent
    else:
        return []
    util = checkout / "tools" / "util" / "include"
    return [str(include_root), *([str(util)] if util.is_dir() else [])]


def header_version(include_root: Path) -> tuple[int, int, int] | None:
    """CUTLASS's version from `<include_root>/cutlass/version.h`, or None when it is absent or unreadable."""
    try:
        text = (include_root / "cutlass" / "version.h").read_text(errors="replace")
    except OSError:
        return None
    parts = dict(_VERSION_DEFINE.findall(text))
    if "MAJOR" not in parts or "MINOR" not in parts:
        return None
    return int(parts["MAJOR"]), int(parts["MINOR"]), int(parts.get("PATCH", "0"))
