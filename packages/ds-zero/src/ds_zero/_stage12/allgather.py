"""After the step: every rank's updated partition copied into every rank's flat parameter buffer.

[Note: all-gather on gloo] Semantically this is an all-gather of the partitions, issued in chunks of
`allgather_bucket_size` elements. On nccl it is `all_gather_into_tensor` straight into the flat buffer
(the own partition is the input, in place). On gloo, `all_gather_into_tensor` copies through temporary
buffers and costs about five times what one broadcast per owner costs (measured with 2 ranks on 80 MB:
0.11 s vs 0.022 s of process CPU time), so there each owner broadcasts its partition in place; DeepSpeed's
`allgather_partitions=false` asks for that form everywhere. Two ranks of one host whose flat buffers are
pair memory copy the peer's partition straight out of its buffer (ds_zero._stage12.pair_memory).
"""

from __future__ import annotations

import logging

import torch.distributed as dist
from torch.distributed import ProcessGroup

import ds_comm
from ds_zero._stage12.flat_buffer import FlatParamGroup
from ds_zero._stage12.pair_memory import gather_from_peer, shared_params

logger = logging.getLogger(__name__)

__all__ = ["PartitionAllGather"]


class PartitionAllGather:
    """Copies each rank's partition of each flat buffer to all ranks.

    Args:
        flats: the flat parameter groups (their own partitions already hold the updated values).
        groups: each flat group's process group (the ranks its partitions are spread over).
        bucket_numel: elements moved per collective round (`allgather_bucket_size`, over all ranks).
        allgather_partitions: use all-gather collectives (True) or one broadcast per owner (False);
            gloo always uses broadcasts (see the note above).
    """

    def __init__(
        self,
        flats: list[FlatParamGroup],
        groups: list[ProcessGroup | None],
        *,
        bucket_numel: int,
        allgather_partitions: bool,
    ) -> None:
        self.flats = flats
        self.groups = groups
        self.worlds = [ds_comm.get_world_size(g) for g in groups]
        self.bucket_numel = max(1, int(bucket_numel))
        backend = dist.get_backend(groups[0]) if ds_comm.is_initialized() and groups else "gloo"
        self.use_broadcast = (not allgather_partitions) or backend == "gloo"
        self._global = [
            [ds_comm.get_global_rank(g, r) for r in range(w)] for g, w in zip(groups, self.worlds, strict=True)
        ]

    def __call__(self) -> None:
        """Run the exchange (blocking)."""
        handles: list = []
        for flat, group, world, global_ranks in zip(self.flats, self.groups, self.worlds, self._global, strict=True):
            if world == 1:
                continue
            shared = shared_params(flat)
            if shared is not None:  # two ranks of one host: straight out of the peer's buffer (pair_memory)
                gather_from_peer(flat, shared)
                continue
            numel = flat.partition_numel
            chunk = max(1, self.bucket_numel // world)
            for lo in range(0, numel, chunk):
                hi = min(lo + chunk, numel)
                if self.use_broadcast:
                    for r in range(world):
                        piece = flat.flat[r * numel + lo : r * numel + hi]
                        handles.append(ds_comm.broadcast(piece, src=global_ranks[r], group=group, async_op=True))
                elif lo == 0 and hi == numel:
                    handles.append(
                        ds_comm.all_gather_into_tensor(flat.flat, flat.own_partition, group=group, async_op=True)
                    )
                else:
                    outputs = [flat.flat[r * numel + lo : r * numel + hi] for r in range(world)]
                    own = flat.own_partition[lo:hi].clone()
                    handles.append(ds_comm.all_gather(outputs, own, group=group, async_op=True))
                if len(handles) >= 4 * world:
                    self._wait(handles)
        self._wait(handles)

    @staticmethod
    def _wait(handles: list) -> None:
        for h in handles:
            if h is not None:
                h.wait()
        handles.clear()
