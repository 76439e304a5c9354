"""Partition arithmetic for flat buffers: padding, who owns which range, which parameter slices a rank holds."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Fragment", "ParamSlot", "fragments_in_range", "owner_pieces", "padded_numel"]


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives inside a flat buffer.

    Attributes:
        name: the parameter's name (from `module.named_parameters()`, or a positional stand-in).
        shape: the parameter's full shape.
        flat_offset: index of its first element in the flat buffer.
        numel: number of elements.
    """

    name: str
    shape: tuple[int, ...]
    flat_offset: int
    numel: int

    @property
    def flat_end(self) -> int:
        return self.flat_offset + self.numel


@dataclass(frozen=True)
class Fragment:
    """Elements `[param_start, param_start + numel)` of the flattened parameter `name`, stored at
    `[partition_start, partition_start + numel)` of one rank's partition tensor."""

    name: str
    param_start: int
    numel: int
    partition_start: int

    def to_list(self) -> list[int | str]:
        """The checkpoint encoding: `[name, param_start, numel, partition_start]` (plain types only)."""
        return [self.name, self.param_start, self.numel, self.partition_start]

    @classmethod
    def from_list(cls, item: list[int | str] | tuple[int | str, ...]) -> Fragment:
        name, param_start, numel, partition_start = item
        return cls(str(name), int(param_start), int(numel), int(partition_start))


def padded_numel(numel: int, num_partitions: int) -> int:
    """`numel` rounded up to a multiple of `num_partitions` (at most `num_partitions - 1` padding elements)."""
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
    return -(-numel // num_partitions) * num_partitions


def fragments_in_range(slots: list[ParamSlot], start: int, end: int) -> list[Fragment]:
    """The parameter slices that fall in flat range `[start, end)`, with offsets relative to `start`.

    Used for a rank's partition `[rank * P, (rank + 1) * P)`: parameters that straddle a partition
    boundary appear on both ranks, each with its own slice.
    """
    out: list[Fragment] = []
    for slot in slots:
        lo, hi = max(slot.flat_offset, start), min(slot.flat_end, end)
        if lo < hi:
            out.append(Fragment(slot.name, lo - slot.flat_offset, hi - lo, lo - start))
    return out


def owner_pieces(start: int, end: int, partition_numel: int) -> list[tuple[int, int, int]]:
    """Split flat range `[start, end)` by owning rank: `[(rank, lo, hi), ...]` in ascending order."""
    pieces = []
    lo = start
    while lo < end:
        rank = lo // partition_numel
        hi = min(end, (rank + 1) * partition_numel)
        pieces.append((rank, lo, hi))
        lo = hi
    return pieces
