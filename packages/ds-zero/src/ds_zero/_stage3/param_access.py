"""Stage 3: one parameter's fp32 master, gradient and optimizer state, whole or as this rank's partition.

Each rank holds the same slice of every partitioned parameter: elements `[r * s, (r + 1) * s)` of the
flattened parameter, `s = ceil(numel / world)`, the last ranks zero-padded. That slice sits at a fixed
offset of its group's fp32 master partition, of the gradient partition (the master's `.grad`, filled
by the reduce-scatters during backward) and of each base-optimizer state tensor of the tile holding it.
The *local* accessors read and write those `s` elements (views, as DeepSpeed returns them); the *whole*
ones all-gather the slices (a collective over the parameter's group) or write this rank's slice of a
whole new value.

Gradients are those of the current accumulation (between backward and step), scaled by the loss
scale (fp16), averaged over the ranks; with none yet (after the step), zeros.

With the optimizer on NVMe (`offload_optimizer.device="nvme"`) the fp32 master, the optimizer state and
the gradient of each sub-group (tile) live in swap files between steps. A getter reads the parameter's
tile back and returns a copy (not a view: there is no memory to view); a setter reads the tile, writes
the parameter's slice into it and writes the tile back, so the next step (and a checkpoint) sees it. A new
gradient also replaces the tile's norm term, which clipping and the overflow check read at the step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

import ds_comm
from ds_zero._param_access import check_numel, state_tensor
from ds_zero._params.partitioned_param import ZeroParamStatus, is_zero_param, state_of
from ds_zero._params.shards import write_shards
from ds_zero._stage3.partition_index import PartitionIndex

__all__ = ["ShardParamAccess"]


class ShardParamAccess:
    """DeepSpeed's stage-3 per-parameter methods for `DeepSpeedZeroOptimizer_Stage3`.

    Parameters this optimizer does not train (frozen ones, ones outside its param groups) give None
    (getters) or are left alone (setters), as in DeepSpeed.
    """

    # provided by DeepSpeedZeroOptimizer_Stage3
    partitions: list[Any]
    optimizer: torch.optim.Optimizer
    optimizer_swapper: Any
    partition_index: PartitionIndex

    def _tile_of(self, param: torch.Tensor) -> tuple[Any, int] | None:
        """(tile, offset of the parameter's slice in the tile) for a parameter this optimizer trains."""
        index: dict[int, tuple[Any, int]] | None = self.__dict__.get("_tile_index")
        if index is None:
            index = {
                id(p): (tile, off)
                for part in self.partitions
                for tile in part.tiles
                for p, off in zip(tile.params, tile.offsets, strict=True)
            }
            self.__dict__["_tile_index"] = index
        if not is_zero_param(param) or not param.requires_grad:
            return None
        return index.get(id(param))

    @staticmethod
    def _what(param: nn.Parameter) -> str:
        return f"parameter {state_of(param).name!r}"

    @contextlib.contextmanager
    def _hp_slice(
        self, param: nn.Parameter, tile: Any, offset: int, key: str | None, *, write: bool = False
    ) -> Iterator[torch.Tensor]:
        """This rank's slice of `param`'s fp32 master (`key` None) or optimizer state `key`.

        In memory, a view. On NVMe, a slice of the tile read back; with `write` the tile is written back
        after the block.
        """
        s = state_of(param).shard_numel
        hp = tile.master if key is None else state_tensor(self.optimizer, tile.master, key, self._what(param))
        swapper = self.optimizer_swapper
        whole = swapper.read_tensor(tile, key) if swapper is not None else None
        if whole is None:  # in memory (or a state tensor the swapper does not move)
            yield hp[offset : offset + s]
            return
        yield whole[offset : offset + s]
        if write:
            swapper.write_tensor(tile, key, whole)

    @contextlib.contextmanager
    def _grad_slice(self, param: nn.Parameter, *, create: bool, write: bool = False) -> Iterator[torch.Tensor | None]:
        """This rank's slice of `param`'s fp32 gradient partition; None when there is none and not `create`.

        In memory, a view of the partition's `.grad` (allocated as zeros when `create`). On NVMe, a slice
        of the tile's gradient read back (zeros when `create` and none exists); with `write` it is written
        back after the block.
        """
        swapper = self.optimizer_swapper
        st = state_of(param)
        if swapper is None:
            slots = self.partition_index[param]
            master, offset = slots.grad_flat, slots.grad_offset
            if master.grad is None:
                if not create:
                    yield None
                    return
                master.grad = torch.zeros(master.shape, dtype=torch.float32, device=master.device)
            yield master.grad[offset : offset + st.shard_numel]
            return
        found = self._tile_of(param)
        assert found is not None
        tile, offset = found
        whole = swapper.grads.read(tile)
        if whole is None:
            if not create:
                yield None
                return
            whole = torch.zeros(tile.numel, dtype=torch.float32)
        yield whole[offset : offset + st.shard_numel]
        if write:
            swapper.grads.write(tile, whole)

    @staticmethod
    def _all_gather(param: nn.Parameter, local: torch.Tensor) -> torch.Tensor:
        st = state_of(param)
        device = st.full.device
        out = torch.empty(st.world_size * st.shard_numel, dtype=torch.float32, device=device)
        mine = local.detach().to(device=device, dtype=torch.float32).contiguous()
        if st.world_size == 1:
            out.copy_(mine)
        else:
            ds_comm.all_gather_into_tensor(out, mine, group=param.ds_process_group)
        return out[: param.ds_numel].view(param.ds_shape)

    @staticmethod
    def _write_own_slice(param: nn.Parameter, value: torch.Tensor, local: torch.Tensor, what: str) -> None:
        st = state_of(param)
        flat = check_numel(value, param.ds_numel, what)
        start = min(st.rank * st.shard_numel, param.ds_numel)
        end = min(start + st.shard_numel, param.ds_numel)
        with torch.no_grad():
            local[: end - start].copy_(flat[start:end])
            local[end - start :].zero_()

    # ------------------------------------------------------------------------------ fp32 master, optimizer state
    def get_full_hp_param(self, param: nn.Parameter, optim_state_key: str | None = None) -> torch.Tensor | None:
        """The whole fp32 master value of `param` (or its optimizer state `optim_state_key`); a collective."""
        found = self._tile_of(param)
        if found is None:
            return None
        with self._hp_slice(param, *found, optim_state_key) as local:
            return self._all_gather(param, local)

    def set_full_hp_param(self, value: torch.Tensor, param: nn.Parameter, optim_state_key: str | None = None) -> None:
        """Set `param`'s fp32 master (or optimizer state) from its whole new `value`; each rank keeps its slice.

        A new master value also goes into the parameter's shard, and into its full values when it is
        gathered (persistent), at once (see the
        [Note: a new fp32 master reaches the model's weights at once] in `ds_zero._param_access`).
        """
        found = self._tile_of(param)
        if found is None:
            return
        with self._hp_slice(param, *found, optim_state_key, write=True) as local:
            self._write_own_slice(param, value, local, self._what(param))
        if optim_state_key is None:
            write_shards([param], [local])
            if param.ds_status is ZeroParamStatus.AVAILABLE:
                with torch.no_grad():
                    state_of(param).full.copy_(value.reshape(param.ds_shape))

    def get_local_fp32_param(self, param: nn.Parameter, optim_state_key: str | None = None) -> torch.Tensor | None:
        """This rank's fp32 master slice of `param` (or of its optimizer state): `ceil(numel / world)` elements,
        a view (a copy when the optimizer is on NVMe)."""
        found = self._tile_of(param)
        if found is None:
            return None
        with self._hp_slice(param, *found, optim_state_key) as local:
            return local

    def set_local_hp_param(self, value: torch.Tensor, param: nn.Parameter, optim_state_key: str | None = None) -> None:
        """Set this rank's fp32 master slice of `param` (or of its optimizer state) to `value`.

        A new master slice also goes into the parameter's shard at once; a parameter held gathered
        (persistent) shows it after the next step, which re-gathers it.
        """
        found = self._tile_of(param)
        if found is None:
            return
        with self._hp_slice(param, *found, optim_state_key, write=True) as local, torch.no_grad():
            local.copy_(check_numel(value, local.numel(), self._what(param)))
        if optim_state_key is None:
            write_shards([param], [local])

    # ------------------------------------------------------------------------------------------- gradients
    def get_fp32_grad_for_param(self, param: nn.Parameter) -> torch.Tensor | None:
        """The whole averaged fp32 gradient of `param` (zeros before any backward); a collective."""
        if self._tile_of(param) is None:
            return None
        with self._grad_slice(param, create=False) as local:
            if local is None:
                local = torch.zeros(state_of(param).shard_numel, dtype=torch.float32)
            return self._all_gather(param, local)

    def set_fp32_grad_for_param(self, value: torch.Tensor, param: nn.Parameter) -> None:
        """Replace `param`'s averaged gradient by the whole `value`; each rank keeps its slice."""
        if self._tile_of(param) is None:
            return
        with self._grad_slice(param, create=True, write=True) as local:
            assert local is not None
            self._write_own_slice(param, value, local, self._what(param))

    def get_local_fp32_grad_for_param(self, param: nn.Parameter) -> torch.Tensor | None:
        """This rank's slice of `param`'s averaged fp32 gradient (a view, a copy on NVMe; zeros before any backward)."""
        if self._tile_of(param) is None:
            return None
        with self._grad_slice(param, create=False) as local:
            return torch.zeros(state_of(param).shard_numel, dtype=torch.float32) if local is None else local

    def set_local_grad_for_param(self, value: torch.Tensor, param: nn.Parameter) -> None:
        """Set this rank's slice of `param`'s averaged gradient to `value`."""
        if self._tile_of(param) is None:
            return
        with self._grad_slice(param, create=True, write=True) as local, torch.no_grad():
            assert local is not None
            local.copy_(check_numel(value, local.numel(), self._what(param)))

    def update_fp32_grad_for_param_vectorized(
        self, update_func: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], param_list: list[nn.Parameter]
    ) -> None:
        """For each trained parameter: gradient = `update_func(whole averaged gradient, param)`; a collective."""
        for p in param_list:
            full = self.get_fp32_grad_for_param(p)
            if full is not None:
                self.set_fp32_grad_for_param(update_func(full, p), p)
