"""Selective unsharding: after warm-up, DeepCompile keeps whole the partitioned parameters that fit.

DeepSpeed 0.19.8's default ZeRO-3 DeepCompile schedule runs its `selective_gather` pass after 5 warm-up
steps: from the memory profiled during those steps it works out how much memory the job never used, and
marks parameters persistent (gathered once, never released) until that headroom is spent. Each parameter
kept whole removes its gather and release from every later forward and backward; its gradient is still
reduce-scattered into the partition, and the optimizer step re-gathers it as it does any persistent
parameter. ds does the same on any accelerator:

- headroom: `total * 0.9` (DeepSpeed's 10% margin) less the peak this rank used so far, on CUDA the
  device's; on a CPU host the ranks share the host, so each rank's total is the host's divided by the
  ranks on it, and never more than the memory the host has free now (divided likewise). The smallest
  headroom of all ranks is used, so every rank keeps the same parameters (their gathers are collectives);
- order: the smallest parameters first. DeepSpeed orders by the profiled gather time per byte; a gather
  costs a fixed latency plus its bytes over the bandwidth, so time per byte falls with size, and smallest
  first is that order without a profiling pass (ties in registration order, the same on every rank);
- a prefix is taken while it fits; the first parameter that does not fit ends the choice, as in DeepSpeed.

With a model that fits the device whole this ends with no gathers at all, which is DeepSpeed's
behaviour too: selective unsharding trades memory the job does not use for speed.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

import ds_comm

__all__ = [
    "MEM_MARGIN",
    "WARMUP_STEPS",
    "UnshardPlan",
    "agreed_headroom",
    "choose_whole",
    "keep_whole",
    "memory_headroom",
]

#: optimizer steps run with every parameter gathered in the graph before the choice (DeepSpeed's WARMUP)
WARMUP_STEPS = 5
#: the share of the device's memory never planned for (DeepSpeed's MEM_MARGIN)
MEM_MARGIN = 0.1


@dataclasses.dataclass(frozen=True)
class UnshardPlan:
    """What selective unsharding chose: the parameters kept whole and the budget it chose them in."""

    headroom_bytes: int
    chosen: tuple[str, ...]
    chosen_bytes: int
    candidates: int
    candidate_bytes: int

    def line(self) -> str:
        return (
            f"selective unsharding: {len(self.chosen)} of {self.candidates} partitioned parameters kept whole "
            f"({self.chosen_bytes / 2**20:.1f} of {self.candidate_bytes / 2**20:.1f} MiB; headroom "
            f"{self.headroom_bytes / 2**20:.1f} MiB per rank)"
        )


def _ranks_on_host() -> int:
    """The ranks sharing this host: the launcher's count (torchrun's and ds's LOCAL_WORLD_SIZE, the MPI
    runners' LOCAL_SIZE, Open MPI's, MPICH's), else every rank (the cautious guess)."""
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"):
        value = os.environ.get(key, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return ds_comm.get_world_size() if ds_comm.is_initialized() else 1


def memory_headroom(accelerator: Any = None) -> int:
    """The bytes this rank may still spend on whole parameters (see the module docstring), at least 0."""
    acc = accelerator if accelerator is not None else ds_comm.get_accelerator()
    peak = int(acc.max_memory_allocated())
    total = int(acc.total_memory())
    if acc.device_name() == "cpu":
        ranks = _ranks_on_host()
        usable = int(total * (1 - MEM_MARGIN)) // ranks - peak
        return max(0, min(usable, int(acc.available_memory()) // ranks))
    return max(0, int(total * (1 - MEM_MARGIN)) - peak)


def agreed_headroom(headroom: int) -> int:
    """The smallest `headroom` over all ranks (a collective; every rank calls it)."""
    if not ds_comm.is_initialized() or ds_comm.get_world_size() == 1:
        return headroom
    value = torch.tensor([headroom], dtype=torch.int64, device=ds_comm.get_accelerator().current_device_name())
    ds_comm.all_reduce(value, op=ds_comm.ReduceOp.MIN)
    return int(value.item())


def _nbytes(param: nn.Parameter) -> int:
    return int(param.ds_numel) * param.element_size()


def choose_whole(
    candidates: Sequence[tuple[str, nn.Parameter]], headroom_bytes: int
) -> tuple[list[tuple[str, nn.Parameter]], UnshardPlan]:
    """The smallest-first prefix of `candidates` (name, partitioned parameter) that fits `headroom_bytes`."""
    chosen: list[tuple[str, nn.Parameter]] = []
    spent = 0
    for name, param in sorted(candidates, key=lambda c: _nbytes(c[1])):  # stable: ties in the given order
        size = _nbytes(param)
        if spent + size > headroom_bytes:
            break
        spent += size
        chosen.append((name, param))
    plan = UnshardPlan(
        headroom_bytes=headroom_bytes,
        chosen=tuple(name for name, _ in chosen),
        chosen_bytes=spent,
        candidates=len(candidates),
        candidate_bytes=sum(_nbytes(p) for _, p in candidates),
    )
    return chosen, plan


def keep_whole(stage3: Any, params: Sequence[nn.Parameter]) -> None:
    """Make `params` persistent and gather them (a collective over their group; every rank calls it).

    `stage3` is the module's `DeepSpeedZeRoOffload`. From here on they are handled as the parameters the
    persistence threshold picked at construction: never released, re-gathered after each optimizer step
    and checkpoint load.
    """
    for p in params:
        p.ds_persist = True
    if params:
        stage3.coordinator.refresh(list(params), "the parameters selective unsharding keeps whole")
