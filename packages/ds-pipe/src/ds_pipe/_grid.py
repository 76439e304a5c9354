"""`PipelineParallelGrid`: a topology bound to this process, with its pipe/data/model process groups."""

from __future__ import annotations

import logging
from typing import Any

from torch.distributed import ProcessGroup

import ds_comm
from ds_pipe._topology import PipeDataParallelTopology, ProcessTopology

logger = logging.getLogger(__name__)

__all__ = ["PipelineParallelGrid"]


def _new_groups(lists: list[list[int]], me: int, distributed: bool) -> tuple[list[int], ProcessGroup | None]:
    """Create one group per rank list (every rank calls this with the same lists); return mine."""
    mine: list[int] = []
    group: ProcessGroup | None = None
    for ranks in lists:
        created = ds_comm.new_group(ranks) if distributed else None
        if me in ranks:
            mine, group = list(ranks), created
    assert mine, f"rank {me} is in none of the groups {lists}"
    return mine, group


class PipelineParallelGrid:
    """This process's place in a `ProcessTopology`, and the process groups along each axis (the "mpu").

    At construction every rank creates, in the same order, through `ds_comm.new_group`:

    - data-parallel groups (ranks differing only in the `data` axis);
    - "model-parallel" groups in DeepSpeed's sense: every rank of one pipeline (pipe x model, same
      `data` coordinate), so `get_model_parallel_rank()` spans stages as DeepSpeed's checkpoint names
      expect (`mp_rank_01` is stage 1 of a 2-stage pipeline);
    - pipe groups (ranks differing only in `pipe`);
    - slice groups: tensor-parallel peers (the `model` axis; a group of one when there is none).

    Without an initialised process group the world is one rank: the topology must have one rank and
    every group is `None` (nothing communicates).

    Args:
        topology: the mesh; default a pure pipeline over the whole world
            (`PipeDataParallelTopology(num_pp=world_size, num_dp=1)`).

    Raises:
        ValueError: the topology's rank count differs from the world size, or it has no `pipe` axis.
    """

    def __init__(self, topology: ProcessTopology | None = None) -> None:
        distributed = ds_comm.is_initialized()
        self.global_rank = ds_comm.get_rank()
        self.world_size = ds_comm.get_world_size()
        if topology is None:
            topology = PipeDataParallelTopology(num_pp=self.world_size, num_dp=1)
        if topology.world_size() != self.world_size:
            raise ValueError(
                f"PipelineParallelGrid: {topology} has {topology.world_size()} ranks but the world has "
                f"{self.world_size}; choose dims whose product is {self.world_size}"
            )
        if "pipe" not in topology.get_axis_names():
            raise ValueError(
                f"PipelineParallelGrid: {topology} has no 'pipe' axis; "
                "use PipeDataParallelTopology or PipeModelDataParallelTopology"
            )
        self._topo = topology
        self.data_parallel_size = max(topology.get_dim("data"), 1)
        self.pipe_parallel_size = max(topology.get_dim("pipe"), 1)
        self.model_parallel_size = max(topology.get_dim("model"), 1)
        self.slice_parallel_size = self.model_parallel_size
        coord = topology.get_coord(self.global_rank)
        self.stage_id: int = coord.pipe
        self.data_parallel_id: int = getattr(coord, "data", 0)
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1
        # Wrapped like DeepSpeed's; use is_first_stage/is_last_stage before talking to a neighbour.
        self.prev_stage = (self.stage_id - 1) % self.pipe_parallel_size
        self.next_stage = (self.stage_id + 1) % self.pipe_parallel_size

        me, world = self.global_rank, self.world_size
        data_lists = topology.get_axis_comm_lists("data") or [[r] for r in range(world)]
        self.dp_group, self.dp_proc_group = _new_groups(data_lists, me, distributed)
        model_lists = [
            topology.get_axis_list("data", dp) if "data" in topology.get_axis_names() else list(range(world))
            for dp in range(self.data_parallel_size)
        ]
        self.ds_model_group, self.ds_model_proc_group = _new_groups(model_lists, me, distributed)
        self.ds_model_rank = self.ds_model_group.index(me)
        self.ds_model_world_size = len(self.ds_model_group)
        self.pp_group, self.pp_proc_group = _new_groups(topology.get_axis_comm_lists("pipe"), me, distributed)
        slice_lists = topology.get_axis_comm_lists("model") or [[r] for r in range(world)]
        self.slice_group, self.slice_proc_group = _new_groups(slice_lists, me, distributed)
        logger.debug(
            "grid on rank %d: stage %d of %d, dp %d of %d, mp %d of %d",
            me,
            self.stage_id,
            self.pipe_parallel_size,
            self.data_parallel_id,
            self.data_parallel_size,
            self.get_slice_parallel_rank(),
            self.slice_parallel_size,
        )

    def _is_grid_valid(self) -> bool:
        """Whether the mesh still spans the world exactly (DeepSpeed's check): its rank count is the current
        world size and every rank lies in exactly one pipeline. The constructor refuses any other mesh; this
        answers again if the process group was re-created since."""
        world = ds_comm.get_world_size()
        pipelines = self._topo.get_axis_comm_lists("pipe") or [list(range(self._topo.world_size()))]
        members = sorted(r for pipeline in pipelines for r in pipeline)
        return self._topo.world_size() == world and members == list(range(world))

    # Topology and stages
    def topology(self) -> ProcessTopology:
        """The mesh this grid was built from."""
        return self._topo

    def get_global_rank(self) -> int:
        """This process's rank in the world."""
        return self.global_rank

    def get_stage_id(self) -> int:
        """This process's pipeline stage."""
        return self.stage_id

    def get_data_parallel_id(self) -> int:
        """This process's coordinate on the `data` axis."""
        return self.data_parallel_id

    def stage_to_global(self, stage_id: int, **kwargs: int) -> int:
        """Global rank of `stage_id` in this process's pipeline (other coordinates overridable by kwargs).

        Raises:
            ValueError: `stage_id` is out of range or a kwarg names an unknown axis.
        """
        coord = self._topo.get_coord(self.global_rank)._asdict()
        unknown = set(kwargs) - set(coord)
        if unknown:
            raise ValueError(f"stage_to_global: unknown axes {sorted(unknown)}; the mesh has {list(coord)}")
        coord.update(pipe=stage_id, **kwargs)
        return self._topo.get_rank(**coord)

    # Pipe axis
    def get_pipe_parallel_rank(self) -> int:
        """Rank within the pipe group (= the stage id)."""
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        """Number of pipeline stages."""
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self) -> ProcessGroup | None:
        """The ranks of this pipeline that share this process's data and model coordinates."""
        return self.pp_proc_group

    # Data axis
    def get_data_parallel_rank(self) -> int:
        """Rank within the data-parallel group."""
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        """Number of data-parallel replicas of each stage."""
        return self.data_parallel_size

    def get_data_parallel_group(self) -> ProcessGroup | None:
        """Ranks holding the same stage and model slice (gradients are averaged over it)."""
        return self.dp_proc_group

    # "Model parallel" in DeepSpeed's mpu sense: one whole pipeline (pipe x model)
    def get_model_parallel_rank(self) -> int:
        """Rank within this pipeline (pipe x model), as DeepSpeed's checkpoint names use it."""
        return self.ds_model_rank

    def get_model_parallel_world_size(self) -> int:
        """Ranks in one pipeline (stages x tensor-parallel degree)."""
        return self.ds_model_world_size

    def get_model_parallel_group(self) -> ProcessGroup | None:
        """Every rank of this pipeline (same `data` coordinate)."""
        return self.ds_model_proc_group

    # Slice (tensor-parallel) axis
    def get_slice_parallel_rank(self) -> int:
        """Coordinate on the `model` axis (0 without one)."""
        coord = self._topo.get_coord(self.global_rank)
        return getattr(coord, "model", 0)

    def get_slice_parallel_world_size(self) -> int:
        """Tensor-parallel degree (1 without a `model` axis)."""
        return self.slice_parallel_size

    def get_slice_parallel_group(self) -> ProcessGroup | None:
        """Tensor-parallel peers: same stage and data coordinate."""
        return self.slice_proc_group

    get_tensor_model_parallel_rank = get_slice_parallel_rank
    get_tensor_model_parallel_world_size = get_slice_parallel_world_size
    get_tensor_model_parallel_group = get_slice_parallel_group

    def describe(self) -> dict[str, Any]:
        """This rank's coordinates and group members, for logs and tests."""
        return {
            "rank": self.global_rank,
            "stage": self.stage_id,
            "data": self.data_parallel_id,
            "slice": self.get_slice_parallel_rank(),
            "dp_group": self.dp_group,
            "pp_group": self.pp_group,
            "model_group": self.ds_model_group,
            "slice_group": self.slice_group,
        }
