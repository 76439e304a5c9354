"""`--bind_cores_to_rank`: split the host's cores (or `--bind_core_list`) evenly across local ranks.

DeepSpeed prefixes each worker with `numactl -C`. We pin with `sched_setaffinity` in the child
before it execs, which needs no extra tool and has the same effect on which cores run the rank
(numactl's memory-node binding is not reproduced).
"""

from __future__ import annotations

import os
import re


def parse_core_list(text: str) -> list[int]:
    """`"0,2-4,7"` into `[0, 2, 3, 4, 7]` (sorted, de-duplicated).

    Raises:
        ValueError: an item that is not `N` or `A-B` with `A <= B`, naming the flag and the item.
    """
    cores: set[int] = set()
    for item in text.split(","):
        item = item.strip()
        match = re.fullmatch(r"([0-9]+)(?:-([0-9]+))?", item)
        if not match:
            raise ValueError(f"--bind_core_list {text!r}: {item!r} is not a core id or range; write e.g. '0,2-4,7'")
        lo = int(match.group(1))
        hi = int(match.group(2)) if match.group(2) is not None else lo
        if hi < lo:
            raise ValueError(f"--bind_core_list {text!r}: range {item!r} runs backwards; write it as '{hi}-{lo}'")
        cores.update(range(lo, hi + 1))
    return sorted(cores)


def split_cores(num_local_procs: int, core_list: str | None = None) -> list[list[int]]:
    """Cores for each local rank: equal contiguous shares; leftovers stay unused.

    Args:
        num_local_procs: ranks on this node.
        core_list: `--bind_core_list`; default: the cores this process may run on.

    Raises:
        ValueError: fewer cores than ranks, or cores this process is not allowed to use.
    """
    allowed = sorted(os.sched_getaffinity(0))
    cores = parse_core_list(core_list) if core_list else allowed
    outside = sorted(set(cores) - set(allowed))
    if outside:
        raise ValueError(
            f"--bind_core_list {core_list!r}: cores {outside} are not available to this process (available: {allowed})"
        )
    per_rank = len(cores) // num_local_procs
    if per_rank == 0:
        raise ValueError(
            f"--bind_cores_to_rank: {len(cores)} core(s) for {num_local_procs} local ranks; "
            "each rank needs at least one core (start fewer ranks or give more cores)"
        )
    return [cores[i * per_rank : (i + 1) * per_rank] for i in range(num_local_procs)]
