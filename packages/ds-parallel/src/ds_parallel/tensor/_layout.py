"""`ShardLayout`: where a parameter is cut and how its shards go back together.

A parameter is cut along one dim (or replicated). Fused projections hold several sections along that
dim (q, k and v; gate and up); each section is split on its own and a rank's shard is its piece of
every section, in order, so the local layer still computes "its q, its k, its v".
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["ShardLayout"]


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """How one parameter is partitioned over `len(sections[0])` tensor-parallel ranks."""

    dim: int | None
    """The tensor dim that is cut; None: replicated (every rank holds the whole parameter)."""
    sections: tuple[tuple[int, ...], ...] = ()
    """Per section along `dim`, every rank's share of it (rank order)."""

    @property
    def replicated(self) -> bool:
        return self.dim is None

    @property
    def full_size(self) -> int:
        return sum(sum(sec) for sec in self.sections)

    def local_size(self, rank: int) -> int:
        return sum(sec[rank] for sec in self.sections)

    def local_sizes(self) -> tuple[int, ...]:
        return tuple(self.local_size(r) for r in range(len(self.sections[0])))

    def shard(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """This rank's shard of the whole parameter `full` (a new contiguous tensor)."""
        if self.dim is None:
            return full.detach().clone()
        if full.shape[self.dim] != self.full_size:
            raise ValueError(
                f"cannot shard a tensor of shape {tuple(full.shape)}: dim {self.dim} should be {self.full_size}"
            )
        pieces = full.split([sum(sec) for sec in self.sections], dim=self.dim)
        mine = [piece.split(sec, dim=self.dim)[rank] for piece, sec in zip(pieces, self.sections, strict=True)]
        return torch.cat(mine, dim=self.dim).contiguous()

    def unshard(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The whole parameter from every rank's shard (rank order); the inverse of `shard`."""
        if self.dim is None:
            return shards[0]
        per_rank = [s.split([sec[r] for sec in self.sections], dim=self.dim) for r, s in enumerate(shards)]
        sections = [torch.cat([parts[i] for parts in per_rank], dim=self.dim) for i in range(len(self.sections))]
        return torch.cat(sections, dim=self.dim)
