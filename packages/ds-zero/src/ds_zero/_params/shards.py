"""A partitioned parameter's shard wherever it lives: `ds_tensor`, or its NVMe swap file (`offload_param`).

With `offload_param.device="nvme"` a shard is not in memory between uses: `state_of(param).swap` (a
`ParamSwapper`) holds it in a swap file. Everything that reads or writes shards in bulk goes through these
functions, which group the swapped parameters by their swapper so each swapper is asked once per call.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ds_zero._params.partitioned_param import state_of

__all__ = ["acquire_shards", "prefetch_shards", "shard_values", "write_shards"]


def shard_values(param: torch.nn.Parameter) -> torch.Tensor:
    """This rank's shard, readable: `ds_tensor`, or a fresh copy read from its NVMe swap file."""
    swap = state_of(param).swap
    if swap is None:
        return param.ds_tensor
    return swap.read_copy(param)


def _by_swapper(params: Iterable[torch.nn.Parameter]) -> list[tuple[Any, list[torch.nn.Parameter]]]:
    groups: dict[int, tuple[Any, list[torch.nn.Parameter]]] = {}
    for p in params:
        swap = state_of(p).swap
        if swap is not None:
            groups.setdefault(id(swap), (swap, []))[1].append(p)
    return list(groups.values())


def write_shards(params: list[torch.nn.Parameter], values: list[torch.Tensor]) -> None:
    """Set the shards of `params` to `values` (each `shard_numel` elements); swapped ones go to NVMe."""
    swapped: dict[int, tuple[Any, list[torch.nn.Parameter], list[torch.Tensor]]] = {}
    with torch.no_grad():
        for p, v in zip(params, values, strict=True):
            state_of(p).secondary_valid = False
            swap = state_of(p).swap
            if swap is None:
                p.ds_tensor.copy_(v)
            else:
                entry = swapped.setdefault(id(swap), (swap, [], []))
                entry[1].append(p)
                entry[2].append(v)
    for swap, ps, vs in swapped.values():
        swap.write(ps, vs)


def acquire_shards(params: list[torch.nn.Parameter], label: str) -> Any:
    """Read the NVMe-swapped shards of `params` in; returns the callable that releases them (None: none swapped)."""
    groups = _by_swapper(params)
    if not groups:
        return None
    done: list[tuple[Any, list[torch.nn.Parameter]]] = []
    try:
        for swap, ps in groups:
            swap.acquire(ps, label)
            done.append((swap, ps))
    except BaseException:
        for swap, ps in done:
            swap.release(ps)
        raise

    def release() -> None:
        for swap, ps in done:
            swap.release(ps)

    return release


def prefetch_shards(params: list[torch.nn.Parameter]) -> bool:
    """Start NVMe reads of the swapped shards of `params`; False when a swapper has no room for more."""
    ok = True
    for swap, ps in _by_swapper(params):
        ok = swap.prefetch(ps) and ok
    return ok
