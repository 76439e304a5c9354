"""NUMA nodes with cores, read from sysfs: DeepSpeed counts each as one CPU "device".

A node with no cores (HBM in flat mode, CXL memory) holds memory only and is not a device; two nodes
listing the same cores (as some firmware reports) count once.
"""

from __future__ import annotations

import re
from pathlib import Path

_NODE_ROOT = Path("/sys/devices/system/node")


def parse_cpulist(text: str) -> list[int]:
    """`"0-3,8,10-11"` -> `[0, 1, 2, 3, 8, 10, 11]` (the kernel's cpulist format).

    Raises:
        ValueError: a part of `text` is not `N` or `N-M`.
    """
    cores: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if match is None:
            raise ValueError(f"cpulist {text.strip()!r}: {part!r} is not N or N-M")
        first, last = int(match.group(1)), int(match.group(2) or match.group(1))
        cores.extend(range(first, last + 1))
    return cores


def numa_core_lists(root: Path = _NODE_ROOT) -> list[list[int]]:
    """The cores of each NUMA node in node order; `[]` where sysfs has no node directory."""
    nodes = sorted(
        (p for p in root.glob("node[0-9]*") if (p / "cpulist").is_file()), key=lambda p: int(p.name[len("node") :])
    )
    return [parse_cpulist((node / "cpulist").read_text()) for node in nodes]


def count_numa_devices(root: Path = _NODE_ROOT) -> int:
    """Nodes that have cores, a node repeating the previous node's cores counted once; at least 1."""
    count, previous = 0, None
    for cores in numa_core_lists(root):
        if cores and cores != previous:
            count += 1
            previous = cores
    return max(count, 1)
