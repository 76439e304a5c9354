"""Automatic tensor parallelism in training: what initialize() does for `autotp_size`.

With `"tensor_parallel": {"autotp_size": N}` (or `tp_model_init(model, tp_size=N, ...)` before
initialize(), merged by `_tp_model_init`), initialize() builds ds-parallel's mesh with a "tp" dim of N
(consecutive ranks; `_parallel.dims`), shards the model's linear layers with AutoTP (training mode: trainable shards,
replicated norms and embeddings), re-points a client optimizer at the shards, and checks on the first
forward that the ranks of each tensor-parallel group received the same batch. As in DeepSpeed 0.19.8,
the cuts come from, in order: `tensor_parallel.partition_config` / `preset_model` (regex layer specs,
unmatched layers whole); else a Hugging Face tensor-parallel plan on the model (`_tp_plan` /
`base_model_tp_plan`, merged by `extract_hf_tp_plan`; Llama's cuts the output head too, its output
gathered); else AutoTP's module-name policy (the output head stays replicated). A plan style
AutoTP does not support is refused before anything is cut. Data parallelism and ZeRO 1-3 then run
over the data-parallel dim only (at stage 3 each tensor-parallel shard is partitioned over it);
replicated parameters get identical gradients on the tensor-parallel ranks (the column-parallel
layers' backward all-reduces their input gradients).

[Note: the norm and the overflow flag] Gradient clipping needs the whole model's norm, and fp16 needs
every shard to skip the same steps. So each stepper (stage 0 fp32 and fp16/bf16, ZeRO 1-3) hands the
tensor-parallel group and its cut gradients (parameters marked `tensor_model_parallel`, DeepSpeed's
marker) to `ds_ops.precision.finish_step`: cut shards' squares are summed over the group, replicated
parameters (layer norms, row-parallel biases, embeddings) are counted by the group's first rank only,
and the overflow flag is OR-ed over the group, after the data-parallel reduction.
Pipelines do not combine with tensor parallelism (refused), nor does NVMe optimizer offload (its norm
comes from per-tile sums; ds-zero refuses it). Sequence parallelism does: with `sequence_parallel_size`
too, the mesh has both dims (`_parallel.dims`), the ranks of a tensor-parallel group hold the same
sequence shard, and data-parallel work spans data x sequence ranks as without tensor parallelism.

Checkpoints hold whole weights and whole optimizer state, so they load at any degree
(`_tp_optimizer_state`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

import ds_comm
from ds_comm import get_accelerator
from ds_engine._optional import require
from ds_engine._parallel.tp_model_init import check_given_group
from ds_engine._plan.dist_info import DistInfo
from ds_engine.config import DeepSpeedConfigError

logger = logging.getLogger(__name__)

__all__ = [
    "TensorParallelBatchMismatchError",
    "TensorParallelState",
    "apply_autotp",
    "check_tensor_parallel",
    "is_cut",
    "publish_tensor_parallel_groups",
    "tensor_parallel_mpu",
    "tensor_parallel_partition_config",
]


def check_tensor_parallel(config: Any, *, tp_size: int, pipeline: bool) -> None:
    """Refuse what does not combine with tensor parallelism (a PipelineModule), by key."""
    if pipeline:
        raise DeepSpeedConfigError(
            f"tensor_parallel.autotp_size={tp_size} does not support a PipelineModule "
            "(pipeline + tensor parallelism is not implemented)"
        )


def publish_tensor_parallel_groups(mpu: Any, dist: DistInfo, *, tp_size: int, given_group: Any) -> None:
    """Check the layout's tensor-parallel group against the degree (and a `tp_model_init(tp_group=...)`), then
    publish the groups as DeepSpeed's `groups` globals (`get_tensor_model_parallel_group()` answers them).

    Raises:
        ValueError: the given group holds other ranks than the mesh's, or the mpu's model-parallel world size
            is not `tp_size`.
    """
    if given_group is not None:
        check_given_group(given_group, mpu.get_model_parallel_group())
    from ds_engine._parallel import groups as tp_groups  # needs ds-parallel, as tensor parallelism does

    tp_groups._set_tp_groups(mpu.get_data_parallel_group(), mpu.get_model_parallel_group())
    if dist.mp_world_size != tp_size:
        raise ValueError(
            f"tensor_parallel.autotp_size={tp_size} but the mpu's model-parallel world size is {dist.mp_world_size}"
        )


def tensor_parallel_partition_config(config: Any, tp_size: int) -> Any:
    """The `AutoTPConfig` that `tensor_parallel.partition_config` / `preset_model` ask for (None: neither set).

    Raises:
        DeepSpeedConfigError: an unknown preset or a malformed spec, naming the key path.
    """
    section = config.parsed.tensor_parallel
    if not section.partition_config and not section.preset_model:
        return None
    tensor = require("ds_parallel", extra="parallel", feature="tensor_parallel.partition_config").tensor
    try:
        return tensor.partition_config_from_settings(section.partition_config, section.preset_model, tp_size)
    except ValueError as err:
        raise DeepSpeedConfigError(str(err)) from None


def tensor_parallel_mpu(tp_size: int) -> Any:
    """Build ds-parallel's process-wide mesh with `tp=tp_size` and return its mpu.

    Raises:
        ImportError: ds-parallel is missing (names `pip install 'ds-engine[parallel]'`).
        ValueError: the world size is not a multiple of `tp_size` (from `ParallelDims`).
    """
    ds_parallel = require("ds_parallel", extra="parallel", feature=f"tensor_parallel.autotp_size={tp_size}")
    return ds_parallel.MeshMPU(ds_parallel.groups.initialize_mesh(tp=tp_size))


@dataclasses.dataclass(frozen=True)
class TensorParallelState:
    """The engine's view of a tensor-parallel model: its group, and whole-weight I/O."""

    group: ProcessGroup
    size: int
    rank: int

    def full_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """The module's state with whole weights (collective on the tensor-parallel group)."""
        return _tensor().full_state_dict(module)

    def load_full_state_dict(self, module: nn.Module, state: dict[str, Any], *, strict: bool) -> None:
        """Load whole weights into the shards (no communication)."""
        _tensor().load_full_state_dict(module, state, strict=strict)

    @staticmethod
    def cut_params(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """The parameters among `params` cut across the group (module note: the norm and the overflow flag)."""
        return [p for p in params if is_cut(p)]


def is_cut(param: torch.Tensor) -> bool:
    """True for a parameter AutoTP cut across the tensor-parallel ranks (DeepSpeed's `tensor_model_parallel`)."""
    return bool(getattr(param, "tensor_model_parallel", False))


def _tensor() -> Any:
    return require("ds_parallel", extra="parallel", feature="tensor parallelism").tensor


def _remap(params: Any, mapping: dict[int, nn.Parameter]) -> Any:
    if isinstance(params, dict):
        return {**params, "params": _remap(params["params"], mapping)}
    if isinstance(params, torch.Tensor):
        return mapping.get(id(params), params)
    return [_remap(p, mapping) for p in params]


def _remap_optimizer(optimizer: Optimizer, mapping: dict[int, nn.Parameter]) -> None:
    for group in optimizer.param_groups:
        replaced = [p for p in group["params"] if id(p) in mapping]
        if any(p in optimizer.state for p in replaced):
            raise ValueError(
                "initialize(): the client optimizer already holds state for parameters AutoTP replaces; build "
                "it before any step, or pass a callable(params)"
            )
        group["params"] = [mapping.get(id(p), p) for p in group["params"]]


def apply_autotp(
    model: nn.Module,
    *,
    group: ProcessGroup,
    tp_grain_size: int,
    optimizer: Any,
    model_parameters: Any,
    partition_config: Any = None,
) -> tuple[TensorParallelState, Any]:
    """Shard `model` for training over `group` (unless `TpTrainingManager` did, `ds_autotp_parsed`); re-point
    `optimizer` (in place) and return the re-pointed `model_parameters`. Registers the first-forward batch
    check (collective on `group`).

    `partition_config` (a `ds_parallel.tensor.AutoTPConfig`, from `tensor_parallel.partition_config` /
    `preset_model`) decides the cuts when given; else the model's Hugging Face tensor-parallel plan, when it
    has one; otherwise AutoTP's module-name policy (DeepSpeed's order).

    Raises:
        ValueError: AutoTP cannot shard the model, or its plan has a style AutoTP does not support
            (the message names the layer and the style).
    """
    tensor = _tensor()
    tensor.set_autotp_mode(training=True)
    before = {name: id(p) for name, p in model.named_parameters()}
    if not getattr(model, "ds_autotp_parsed", False):  # TpTrainingManager has sharded it already
        plan = None if partition_config is not None else tensor.extract_hf_tp_plan(model)
        if ds_comm.get_rank() == 0 and partition_config is None:
            logger.info(
                "AutoTP: %s",
                f"partitioning by the Hugging Face tp_plan {plan}"
                if plan
                else "no Hugging Face tp_plan on the model; partitioning by the module-name policy",
            )
        tensor.shard_model(
            model,
            tp_group=group,
            training=True,
            tp_grain_size=tp_grain_size,
            tp_plan=plan,
            partition_config=partition_config,
        )
    # DeepSpeed attaches how each parameter is cut to the model (its UNIVERSAL_CHECKPOINT_INFO attribute)
    model.universal_checkpoint_info = tensor.collect_autotp_universal_checkpoint_info(model)
    mapping = {before[name]: p for name, p in model.named_parameters() if name in before and before[name] != id(p)}
    if isinstance(optimizer, Optimizer):
        _remap_optimizer(optimizer, mapping)
    if model_parameters is not None and not hasattr(model_parameters, "__next__"):
        model_parameters = _remap(list(model_parameters), mapping)
    model.register_forward_pre_hook(_BatchCheck(group), prepend=True, with_kwargs=True)
    return TensorParallelState(group, ds_comm.get_world_size(group), ds_comm.get_rank(group)), model_parameters


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(o) for o in obj) if not hasattr(obj, "_fields") else type(obj)(*map(_to_cpu, obj))
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (int, float, str, bytes, bool, type(None))) or isinstance(b, (int, float, str, bytes, bool)):
        return bool(a == b)
    # Other objects (HF generate's KV cache, configs, ...) travel as pickles whose equality is identity:
    # the same type on both ranks is all that can be asked of them.
    return type(a) is type(b)


#: DeepSpeed's message (its test compares it verbatim); ds's explanation is attached as a note.
BATCH_MISMATCH = (
    "Data inconsistency within the TP group. Please check the Dataloader implementation to ensure consistency."
)


class TensorParallelBatchMismatchError(ds_comm.UsageError):
    """The ranks of a tensor-parallel group were given different batches (a ValueError, and the
    AssertionError DeepSpeed raises)."""


class _BatchCheck:
    """First forward only: the tensor-parallel ranks must have received the same inputs (DeepSpeed checks too)."""

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group
        self.done = False

    def __call__(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self.done:
            return
        self.done = True
        mine = _to_cpu((tuple(args), dict(kwargs)))
        box = [mine]
        ds_comm.broadcast_object_list(box, src=ds_comm.get_global_rank(self.group, 0), group=self.group)
        acc = get_accelerator()
        device = torch.device("cpu") if acc.name == "cpu" else acc.device(ds_comm.get_local_rank())
        flag = torch.tensor([0.0 if _same(box[0], mine) else 1.0], device=device)
        ds_comm.all_reduce(flag, group=self.group)
        if flag.item() > 0:
            err = TensorParallelBatchMismatchError(BATCH_MISMATCH)
            err.add_note(
                "tensor parallelism: the ranks of a tensor-parallel group received different inputs in their first "
                "forward; each group must see the same batch (shard data over the data-parallel ranks only, e.g. "
                "with engine.deepspeed_io or a sampler over engine.dp_world_size / get_data_parallel_rank())"
            )
            raise err
