"""`deepspeed.checkpoint.ZeROCheckpoint`: the ZeRO optimizer-state files of a checkpoint, by target rank.

It lists a tag directory's `*zero_pp_rank_{dp}_mp_rank_{mp}_optim_states.pt` files, learns the source
layout (`get_model_3d_descriptor`, or the `source_3d` a caller already has), and maps every rank of a
target layout (the source's own until `reshape` picks a smaller one) to the source files it reads.
`get_state_for_rank` loads and merges those files: padding stripped from each source's flat optimizer
states (so the merged tensors hold only real elements), `partition_count` set to the target's dp degree.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch

import ds_comm
from ds_engine._checkpoint.constants import BASE_OPTIMIZER_STATE, GROUP_PADDINGS, OPTIMIZER_STATE_DICT, PARTITION_COUNT
from ds_engine._checkpoint.offline.reshape_3d_utils import get_model_3d_descriptor, model_3d_desc
from ds_engine._checkpoint.offline.reshape_utils import basic_folder_validation, get_zero_files, merge_state

__all__ = ["ZeROCheckpoint"]

GROUP_STATE_KEY = "state"


class ZeROCheckpoint:
    """The ZeRO files of the tag directory `dir`, mapped onto a (possibly smaller) target layout.

    Raises:
        FileNotFoundError: `dir` does not exist or holds no ZeRO optimizer-state files.
    """

    def __init__(self, dir: str | os.PathLike[str], source_3d: model_3d_desc | None = None) -> None:  # noqa: A002
        basic_folder_validation(dir)
        self.dir = os.fspath(dir)
        self.file_list = get_zero_files(dir)
        self.num_files = len(self.file_list)
        if not self.file_list:
            raise FileNotFoundError(f"ZeROCheckpoint: no ZeRO optimizer-state files (*zero_pp_rank_*) in {self.dir}")
        self.src_3d = get_model_3d_descriptor(dir) if source_3d is None else source_3d
        self.reshape(model_3d_desc(self.src_3d.pp_degree, self.src_3d.tp_degree, self.src_3d.dp_degree))

    def get_src_world_size(self) -> int:
        return self.src_3d.world_size()

    def get_src_tp_degree(self) -> int:
        return self.src_3d.tp_degree

    def get_src_pp_degree(self) -> int:
        return self.src_3d.pp_degree

    def get_src_dp_degree(self) -> int:
        return self.src_3d.dp_degree

    def reshape(self, target_3d_desc: model_3d_desc) -> None:
        """Map onto `target_3d_desc` from now on (ValueError if the source cannot be reshaped to it)."""
        self._3d_file_map = self.src_3d.reshape(target_3d_desc)
        self.target_3d = target_3d_desc

    def get_file_indices_for_rank(self, pp_index: int, tp_index: int, dp_index: int) -> list[int]:
        """Indices into `file_list` of the source files target rank (pp, tp, dp) reads."""
        if not 0 <= dp_index < len(self._3d_file_map):
            raise IndexError(f"dp_index {dp_index} outside the target dp degree {len(self._3d_file_map)}")
        return self._3d_file_map[dp_index].get_data(pp_index, tp_index)

    def get_files_for_rank(self, pp_index: int, tp_index: int, dp_index: int) -> list[str]:
        """The source file paths target rank (pp, tp, dp) reads, in merge order."""
        return [self.file_list[i] for i in self.get_file_indices_for_rank(pp_index, tp_index, dp_index)]

    def get_state_for_rank(
        self,
        pp_index: int,
        tp_index: int,
        dp_index: int,
        keys_to_ignore: Iterable[str] = (),
        strip_tensor_paddings: bool = True,
    ) -> dict[str, Any] | None:
        """The merged optimizer-states dict of target rank (pp, tp, dp) (None if it reads no file)."""
        ignored = list(keys_to_ignore)
        merged: dict[str, Any] | None = None
        for path in self.get_files_for_rank(pp_index, tp_index, dp_index):
            sd = ds_comm.load_checkpoint_file(path)
            for key in ignored:
                sd.pop(key, None)
            if strip_tensor_paddings:
                self._strip_tensor_paddings(sd)
            merged = sd if merged is None else merge_state(merged, sd)
            self._update_partition_count(merged)
            if strip_tensor_paddings:
                self._clear_group_paddings(merged)
        return merged

    def print_3d_index_map(self, tag: str | None = None) -> None:
        if tag:
            print(f"3D index map: {tag}")
        for dp_index, grid in enumerate(self._3d_file_map):
            grid.print_data(f"dp = {dp_index}")

    def print_3d_file_map(self, tag: str | None = None) -> None:
        if tag:
            print(f"3D file map: {tag}")
        for dp_index, grid in enumerate(self._3d_file_map):
            for pp_index in range(grid.pp_degree):
                for tp_index in range(grid.tp_degree):
                    files = [self.file_list[i] for i in grid.get_data(pp_index, tp_index)]
                    print(f"{pp_index}, {tp_index}, {dp_index} => {files}")

    @staticmethod
    def _optimizer_state(sd: dict[str, Any], key: str) -> Any:
        optimizer_state = sd.get(OPTIMIZER_STATE_DICT)
        return optimizer_state.get(key) if isinstance(optimizer_state, dict) else None

    def _strip_tensor_paddings(self, sd: dict[str, Any]) -> None:
        """Cut each group's padding off the end of its flat state tensors (the `step` counter is kept)."""
        base = self._optimizer_state(sd, BASE_OPTIMIZER_STATE)
        group_states = base.get(GROUP_STATE_KEY) if isinstance(base, dict) else None
        paddings = self._optimizer_state(sd, GROUP_PADDINGS)
        if group_states is None or paddings is None:
            return
        for key, group_state in group_states.items():
            if not paddings[key]:
                continue
            for name, value in group_state.items():
                if name != "step" and torch.is_tensor(value):
                    group_state[name] = value.narrow(0, 0, value.numel() - paddings[key]).clone()

    def _clear_group_paddings(self, sd: dict[str, Any]) -> None:
        paddings = self._optimizer_state(sd, GROUP_PADDINGS)
        if paddings:
            sd[OPTIMIZER_STATE_DICT][GROUP_PADDINGS] = [0] * len(paddings)

    def _update_partition_count(self, sd: dict[str, Any]) -> None:
        counts = self._optimizer_state(sd, PARTITION_COUNT)
        if counts:
            sd[OPTIMIZER_STATE_DICT][PARTITION_COUNT] = [self.target_3d.dp_degree] * len(counts)
