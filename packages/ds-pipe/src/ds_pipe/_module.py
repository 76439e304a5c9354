"""`PipelineModule`: a sequence of layers split into stages, each process building only its own stage."""

from __future__ import annotations

import functools
import itertools
import logging
import os
import random
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

import ds_comm
from ds_pipe import checkpointing
from ds_pipe._grid import PipelineParallelGrid
from ds_pipe._layer_io import CheckpointEngine, layer_file_name, load_layers, save_layers
from ds_pipe._layer_spec import LayerSpec, TiedLayerSpec
from ds_pipe._partition import partition_balanced, partition_uniform
from ds_pipe._tied import TiedGroup, allreduce_tied_grads, broadcast_tied_weights, build_tied_groups
from ds_pipe._topology import PipeDataParallelTopology, ProcessTopology

logger = logging.getLogger(__name__)

__all__ = ["PartitionMethodError", "PipelineModule"]

Layer = nn.Module | LayerSpec | Callable[[Any], Any]


class PartitionMethodError(ValueError, NotImplementedError):
    """An unknown or unusable `partition_method` (a NotImplementedError too, as in DeepSpeed)."""


def _seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def _layer_type_name(layer: Layer) -> str:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    return type(layer).__name__ if isinstance(layer, nn.Module) else getattr(layer, "__name__", type(layer).__name__)


class PipelineModule(nn.Module):
    """A model given as a list of layers, split into pipeline stages; this process builds its stage.

    Each entry of `layers` is a `LayerSpec` (built here only if this stage owns it), a
    `TiedLayerSpec`, an already built `nn.Module`, or any callable (e.g. a reshape lambda). Layer
    `i`'s output is layer `i + 1`'s input (one argument, which may be a tuple).

    At construction: the topology and grid are set up (creating process groups on every rank),
    layers are partitioned, this stage's layers are built (seeded per layer with `seed_layers`),
    the module moves to the accelerator's current device, tie groups are created and tied weights
    are broadcast from their lowest owning stage.

    Args:
        layers: the model, in order.
        num_stages: pipeline stages; with no topology the world is split `num_stages x data`.
        topology: a `ProcessTopology` with a `pipe` axis (overrides `num_stages`).
        loss_fn: `loss_fn(outputs, labels)` run on the last stage; None means the last layer's
            output is the loss.
        seed_layers: seed the RNG with `base_seed + layer_idx` (or `seed_fn` of it) before building
            each layer, and with `base_seed * forward_count + layer_idx` before running it, so
            initialisation and dropout do not depend on the partition.
        seed_fn: the seeding function for `seed_layers` (default: `random` and `torch` seeds).
        base_seed: see `seed_layers`.
        partition_method: "parameters" (balance trainable parameters, default), "uniform" (balance
            layer counts), "type:<regex>" (balance layers whose class name matches, case-insensitive),
            or explicit boundaries `[0, b1, ..., num_layers]` (stage `s` holds layers `b_s:b_{s+1}`).
        activation_checkpoint_interval: checkpoint every this many layers (0: off).
        activation_checkpoint_func: the checkpoint function (default `ds_pipe.checkpointing.checkpoint`).
        checkpointable_layers: class names that may be checkpointed; default: any chunk with parameters.
        dynamic_shape: activations may change shape between micro-batches (the executor then
            checks for a new shape on every send instead of once per batch).

    Raises:
        ValueError: neither `num_stages` nor `topology`, a world not divisible by `num_stages`,
            `num_stages` disagreeing with the topology, or bad explicit boundaries.
        PartitionMethodError: an unknown method, or a `type:` regex that matches no layer.
        TypeError: a layer that is neither a module, a spec nor a callable.
    """

    def __init__(
        self,
        layers: Sequence[Layer],
        num_stages: int | None = None,
        topology: ProcessTopology | None = None,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        seed_layers: bool = False,
        seed_fn: Callable[[int], None] | None = None,
        base_seed: int = 1234,
        partition_method: str | Sequence[int] = "parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func: Callable[..., Any] = checkpointing.checkpoint,
        checkpointable_layers: Sequence[str] | None = None,
        dynamic_shape: bool = False,
    ) -> None:
        super().__init__()
        self._layer_specs = list(layers)
        for idx, layer in enumerate(self._layer_specs):
            if not (isinstance(layer, (nn.Module, LayerSpec)) or callable(layer)):
                raise TypeError(
                    f"PipelineModule: layer {idx} must be an nn.Module, LayerSpec, TiedLayerSpec or "
                    f"callable, got {type(layer).__name__}"
                )
        if isinstance(activation_checkpoint_interval, bool) or activation_checkpoint_interval < 0:
            raise ValueError(
                "PipelineModule: activation_checkpoint_interval must be an int >= 0, got "
                f"{activation_checkpoint_interval!r}"
            )
        self._topo = self._resolve_topology(num_stages, topology)
        self._grid = PipelineParallelGrid(self._topo)
        self.num_stages = self._topo.get_dim("pipe")
        self.global_rank = self._grid.get_global_rank()
        self.world_size = self._grid.world_size
        self.stage_id = self._grid.get_stage_id()
        self.loss_fn = loss_fn
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn, base_seed
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = list(checkpointable_layers) if checkpointable_layers is not None else None
        # Per block of `activation_checkpoint_interval` local layers: checkpoint it or not. Decided
        # once per interval (DeepSpeed's names), not per micro-batch; see _precompute_checkpointable_values.
        self.is_checkpointable_results: list[bool] = []
        self.is_checkpointable_results_interval: int | None = None
        self.dynamic_shape = dynamic_shape
        self.micro_offset = 0
        self.parts = self._partition(partition_method)
        self._local_start, self._local_stop = self.parts[self.stage_id], self.parts[self.stage_id + 1]
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self.forward_funcs: list[Callable[[Any], Any]] = []
        self._local_modules: list[nn.Module | None] = []
        self._build()
        self.to(ds_comm.get_accelerator().device())
        self._tied_groups = self._setup_tied_groups()
        broadcast_tied_weights(list(self._tied_groups.values()))

    # Construction
    def _resolve_topology(self, num_stages: int | None, topology: ProcessTopology | None) -> ProcessTopology:
        if topology is not None:
            if num_stages is not None and num_stages != topology.get_dim("pipe"):
                raise ValueError(
                    f"PipelineModule: num_stages={num_stages} disagrees with {topology} "
                    f"(pipe dim {topology.get_dim('pipe')}); pass one of them"
                )
            return topology
        if num_stages is None:
            raise ValueError("PipelineModule: must provide num_stages or topology")
        world = ds_comm.get_world_size()
        if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1 or world % num_stages:
            raise ValueError(
                f"PipelineModule: num_stages={num_stages!r} must be an int >= 1 dividing the world size {world}"
            )
        return PipeDataParallelTopology(num_pp=num_stages, num_dp=world // num_stages)

    def _partition(self, method: str | Sequence[int]) -> list[int]:
        num_layers = len(self._layer_specs)
        if not isinstance(method, str):
            parts = list(method)
            ok = (
                len(parts) == self.num_stages + 1
                and parts[0] == 0
                and parts[-1] == num_layers
                and all(isinstance(b, int) for b in parts)
                and all(a <= b for a, b in itertools.pairwise(parts))
            )
            if not ok:
                raise ValueError(
                    f"PipelineModule: explicit partition {parts} must be {self.num_stages + 1} "
                    f"non-decreasing ints from 0 to {num_layers} "
                    "(stage s holds layers parts[s]:parts[s+1])"
                )
            return parts
        lowered = method.lower()
        if lowered == "uniform":
            return partition_uniform(num_layers, self.num_stages)
        if lowered == "parameters":
            return partition_balanced([self._count_params(layer) for layer in self._layer_specs], self.num_stages)
        if lowered.startswith("type:"):
            pattern = method[len("type:") :]
            names = [_layer_type_name(layer) for layer in self._layer_specs]
            weights = [1 if re.search(pattern, name, re.IGNORECASE) else 0 for name in names]
            if not any(weights):
                raise PartitionMethodError(
                    f"partition_method {method!r} matches no layer; layer types are {sorted(set(names))}"
                )
            return partition_balanced(weights, self.num_stages)
        raise PartitionMethodError(
            f"Partitioning method {method} not implemented. Use 'parameters', 'uniform', "
            "'type:<regex>' or explicit boundaries"
        )

    @staticmethod
    def _count_params(layer: Layer) -> int:
        if isinstance(layer, LayerSpec):
            return layer.count_parameters()
        if isinstance(layer, nn.Module):
            return sum(p.numel() for p in layer.parameters() if p.requires_grad)
        return 0

    def _build(self) -> None:
        for idx in range(self._local_start, self._local_stop):
            layer = self._layer_specs[idx]
            if self.seed_layers:
                (self.seed_fn or _seed_all)(self.base_seed + idx)
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    self.tied_modules[layer.key] = layer.build()
                    self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
                module = self.tied_modules[layer.key]
                func = module if layer.forward_fn is None else functools.partial(layer.forward_fn, module)
                self.forward_funcs.append(func)
                self._local_modules.append(module)
            elif isinstance(layer, (LayerSpec, nn.Module)):
                module = layer.build() if isinstance(layer, LayerSpec) else layer
                self.add_module(str(idx), module)
                self.forward_funcs.append(module)
                self._local_modules.append(module)
            else:
                self.forward_funcs.append(layer)
                self._local_modules.append(None)

    def _setup_tied_groups(self) -> dict[str, TiedGroup]:
        owners: dict[str, list[int]] = {}
        for idx, layer in enumerate(self._layer_specs):
            if isinstance(layer, TiedLayerSpec):
                stages = owners.setdefault(layer.key, [])
                stage = self.stage_owner(idx)
                if stage not in stages:
                    stages.append(stage)
        return build_tied_groups(
            self._topo, owners, self.global_rank, dict(self.tied_modules.items()), self.tied_weight_attrs
        )

    # Forward
    def forward(self, forward_input: Any) -> Any:
        """Run this stage's layers on `forward_input` (checkpointing every `activation_checkpoint_interval`)."""
        self.micro_offset += 1
        offset = self.micro_offset
        num_local = len(self.forward_funcs)
        if self.activation_checkpoint_interval == 0:
            return self._range_fn(0, num_local, offset)(forward_input)
        self._precompute_checkpointable_values()
        x = forward_input
        starts = range(0, num_local, self.activation_checkpoint_interval)
        for start, checkpointable in zip(starts, self.is_checkpointable_results, strict=True):
            end = min(start + self.activation_checkpoint_interval, num_local)
            run = self._range_fn(start, end, offset)
            if checkpointable:
                x = self.activation_checkpoint_func(run, *(x if isinstance(x, tuple) else (x,)))
            else:
                x = run(x)
        return x

    def _range_fn(self, start: int, end: int, offset: int) -> Callable[..., Any]:
        """A function running local layers `start:end`; it takes the input as one or several arguments."""

        def run(*inputs: Any) -> Any:
            x = inputs[0] if len(inputs) == 1 else inputs
            for local_idx in range(start, end):
                if self.seed_layers:
                    (self.seed_fn or _seed_all)(self.base_seed * offset + self._local_start + local_idx)
                x = self.forward_funcs[local_idx](x)
            return x

        return run

    def _precompute_checkpointable_values(self) -> None:
        """Fill `is_checkpointable_results` (one bool per block of local layers) for the current interval.

        A no-op when the interval is 0 or the results already belong to it; `set_checkpoint_interval`
        and `forward` call it, so the blocks `forward` walks always match the results it reads.
        """
        interval = self.activation_checkpoint_interval
        if interval <= 0 or self.is_checkpointable_results_interval == interval:
            return
        num_local = len(self.forward_funcs)
        self.is_checkpointable_results = [
            self._is_checkpointable(self.forward_funcs[start : start + interval])
            for start in range(0, num_local, interval)
        ]
        self.is_checkpointable_results_interval = interval

    def _is_checkpointable(self, funcs: Sequence[Callable[[Any], Any]]) -> bool:
        if self.checkpointable_layers is not None:
            return all(type(f).__name__ in self.checkpointable_layers for f in funcs)
        return any(isinstance(f, nn.Module) and any(True for _ in f.parameters()) for f in funcs)

    # Queries (DeepSpeed's names)
    def partitions(self) -> list[int]:
        """Stage boundaries: stage `s` holds global layers `partitions()[s]:partitions()[s + 1]`."""
        return list(self.parts)

    def stage_owner(self, layer_idx: int) -> int:
        """The stage holding global layer `layer_idx`.

        Raises:
            ValueError: `layer_idx` is out of range.
        """
        if not 0 <= layer_idx < len(self._layer_specs):
            raise ValueError(f"stage_owner: layer {layer_idx} is out of range [0, {len(self._layer_specs)})")
        for stage in range(self.num_stages):
            if self.parts[stage] <= layer_idx < self.parts[stage + 1]:
                return stage
        raise AssertionError(f"layer {layer_idx} is in no partition of {self.parts}")

    def topology(self) -> ProcessTopology:
        """The process topology."""
        return self._topo

    def mpu(self) -> PipelineParallelGrid:
        """The grid (DeepSpeed's model-parallel unit)."""
        return self._grid

    def num_pipeline_stages(self) -> int:
        """Number of pipeline stages."""
        return self.num_stages

    def set_checkpoint_interval(self, interval: int) -> None:
        """Change `activation_checkpoint_interval` (0 turns checkpointing off)."""
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
            raise ValueError(f"set_checkpoint_interval: interval must be an int >= 0, got {interval!r}")
        self.activation_checkpoint_interval = interval
        self._precompute_checkpointable_values()

    def allreduce_tied_weight_gradients(self) -> None:
        """Sum tied weights' gradients over their tie groups (all-reduce on each tie group)."""
        allreduce_tied_grads(list(self._tied_groups.values()))

    def get_tied_weights_and_groups(self) -> list[tuple[torch.Tensor, ProcessGroup | None]]:
        """(weight, tie group) for every tied weight this stage shares with another stage."""
        return [(w, t.group) for t in self._tied_groups.values() for w in t.weights()]

    # Per-layer checkpoints
    def _rank_repr(self) -> str:
        return self._topo.get_rank_repr(self.global_rank)

    def ckpt_prefix(self, checkpoints_path: str | os.PathLike[str], tag: str) -> str:
        """`<checkpoints_path>/<tag>/layer_` (the prefix of this model's layer files)."""
        return os.path.join(checkpoints_path, str(tag), "layer_")

    def ckpt_layer_path(self, ckpt_dir: str | os.PathLike[str], local_layer_idx: int) -> str:
        """Path of the file for local layer `local_layer_idx` in `ckpt_dir`."""
        return os.path.join(ckpt_dir, layer_file_name(self._local_start + local_layer_idx, self._rank_repr()))

    def ckpt_layer_path_list(self, ckpt_dir: str | os.PathLike[str], local_layer_idx: int) -> list[str]:
        """Every file of local layer `local_layer_idx` in `ckpt_dir` (one per tensor-parallel rank)."""
        idx = self._local_start + local_layer_idx
        return sorted(str(p) for p in Path(ckpt_dir).glob(f"layer_{idx:02d}-*model_states.pt"))

    def _local_layers(self) -> list[tuple[int, nn.Module | None]]:
        return [(self._local_start + i, m) for i, m in enumerate(self._local_modules)]

    def save_state_dict(
        self,
        save_dir: str | os.PathLike[str],
        checkpoint_engine: CheckpointEngine | None = None,
        exclude_frozen_params: bool = False,
        parallel_write: bool = False,
    ) -> list[Path]:
        """Write one file per local layer into `save_dir`; returns the paths this rank wrote.

        Data-parallel rank 0 writes every local layer; with `parallel_write` the layers are spread
        over the data-parallel ranks. No collectives. Layer files are named by global index, so
        `load_state_dir` works with any number of stages.
        """
        layers = self._local_layers()
        dp_rank, dp_size = self._grid.get_data_parallel_rank(), self._grid.get_data_parallel_world_size()
        if parallel_write:
            bounds = partition_uniform(len(layers), dp_size)
            layers = layers[bounds[dp_rank] : bounds[dp_rank + 1]]
        elif dp_rank != 0:
            return []
        return save_layers(
            layers, save_dir, self._rank_repr(), exclude_frozen_params=exclude_frozen_params, engine=checkpoint_engine
        )

    def load_state_dir(
        self, load_dir: str | os.PathLike[str], checkpoint_engine: CheckpointEngine | None = None, strict: bool = True
    ) -> None:
        """Load this stage's layers from the layer files in `load_dir` (saved with any stage count).

        Raises:
            FileNotFoundError: a layer file is missing.
            RuntimeError: `strict` and a file's keys do not match its layer.
        """
        load_layers(self._local_layers(), load_dir, self._rank_repr(), strict=strict, engine=checkpoint_engine)
