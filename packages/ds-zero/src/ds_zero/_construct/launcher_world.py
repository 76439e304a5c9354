"""The check that `Init` partitions across the world the launcher started, not a stray one-rank group.

[Note: the silent one-rank fallback] `Init` splits parameters across the process group it finds. When a
library initialised a one-process group before `Init` ran (`from_pretrained` before
`init_distributed()` is the usual way), every rank of a multi-process launch finds a group of one, keeps
each parameter whole and allocates the full model: an out-of-memory that looks like "the model is too
big". The launcher's `WORLD_SIZE` says how many processes there really are, so a group of one under a
`WORLD_SIZE` above one is a contradiction `Init` refuses before it allocates anything. A group of one the
caller passed explicitly (`data_parallel_group=`) is taken as intended and not checked.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["single_rank_group_error"]


def single_rank_group_error(
    dp_world_size: int, explicit_process_group: object | None, env: Mapping[str, str | None] | None = None
) -> str | None:
    """The error message for a one-rank group under a multi-process launch, or None when there is none.

    Args:
        dp_world_size: the size of the group `Init` would partition across.
        explicit_process_group: the group the caller passed to `Init` (None: `Init` took the world).
        env: the environment to read `WORLD_SIZE` from (None: `os.environ`). A missing, empty or
            non-integer `WORLD_SIZE` means no launcher said otherwise, so no error.

    Returns:
        None unless the group has one rank, was not passed explicitly, and `WORLD_SIZE` > 1; then a
        message naming both sizes, the likely cause and the two fixes.
    """
    if dp_world_size != 1 or explicit_process_group is not None:
        return None
    environ = os.environ if env is None else env
    try:
        launcher_world = int(environ.get("WORLD_SIZE") or 0)
    except (TypeError, ValueError):
        return None
    if launcher_world <= 1:
        return None
    return (
        f"ds_zero.Init found a process group of 1 rank, but the launcher set WORLD_SIZE={launcher_world}: a "
        "one-process group was initialised before Init (e.g. by from_pretrained before "
        "deepspeed.init_distributed()), so every rank would keep the whole model unpartitioned. Call "
        "deepspeed.init_distributed() before building the model under zero.Init, or pass "
        "data_parallel_group= explicitly if one rank is intended."
    )
