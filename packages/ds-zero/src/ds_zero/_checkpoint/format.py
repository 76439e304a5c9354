"""The ZeRO partition checkpoint format (shared by stages 1, 2 and 3) and the readers that rebuild full tensors.

[Note: the per-rank optimizer state dict, format version 1]

`optimizer.state_dict()` of every ZeRO optimizer in ds_zero returns THIS rank's dict below. The engine (or
`ds_zero.save_zero_checkpoint`) stores it as `{"optimizer_state_dict": <dict>, ...}` in
`<tag>/zero_pp_rank_{dp_rank}_mp_rank_00_optim_states.pt` (optionally prefixed `bf16_`). Every value is a
plain Python type or a tensor, so the files load with `torch.load(..., weights_only=True)`.

Required keys (both stages write them; readers rely on nothing else):

- `"ds_zero_format"` (int): the format version, `FORMAT_VERSION`.
- `"zero_stage"` (int): 1, 2 or 3.
- `"partition_count"` (int): data-parallel world size at save time = number of ranks that saved a file.
- `"dp_rank"` (int): this rank's index in the data-parallel group (its file's `zero_pp_rank_N`).
- `"model_dtype"` (str): the training dtype of the model parameters: "float32", "bfloat16" or "float16".
- `"single_partition_of_fp32_groups"` (list[Tensor]): one 1-D fp32 tensor per flat partition `k` this
  rank holds: the fp32 master values (DeepSpeed's key name). Stage 1/2: one per param group. Stage 3 may
  hold several per param group (sub-groups).
- `"partitions"` (list[dict]): metadata of each flat partition `k`, same order and length:
    - `"group_index"` (int): the base optimizer param group the partition belongs to.
    - `"numel"` (int): length of the partition tensor, padding included.
    - `"padding"` (int): trailing elements that hold no parameter (zeros).
    - `"fragments"` (list[list]): `[name, param_start, numel, partition_start]` per parameter slice:
      elements `[param_start, param_start + numel)` of the flattened parameter `name` are stored at
      `[partition_start, partition_start + numel)` of the partition tensor. Over all ranks the fragments
      of a parameter tile it exactly once.
    - `"param_shapes"` (dict[str, list[int]]): full shape of each parameter named in `"fragments"`.
- `"base_optimizer_state"` (dict): the base optimizer's `state_dict()` over the partitions:
  `{"state": {k: {key: value}}, "param_groups": [...]}`; the base optimizer's k-th parameter is
  partition `k`. A 1-D tensor value with `numel == partitions[k]["numel"]` is partition-shaped and
  follows the same fragments (exp_avg, exp_avg_sq, momentum_buffer, ...); anything else (`step`, a
  0-dim tensor) is per-group and is copied as is.
- `"loss_scaler"` (dict): `LossScaler.state_dict()` of ds_ops; `"dynamic_loss_scale"` (bool).
- `"overflow"` (bool): whether the last step overflowed. `"clip_grad"` (float): the clipping norm.

Optional keys: `"shared_params"` (dict alias -> stored name, for tied parameters: the alias gets the same
tensor on consolidation), `"frozen_param_shapes"` (dict name -> shape of parameters without gradients:
not partitioned, they come from the model states file), `"offload_optimizer"` (str: "none", "cpu" or "nvme";
informational: a checkpoint loads with any offload setting), `"master_dtype"` (str: "float32" or "bfloat16",
the dtype the masters, gradient partitions and optimizer moments were trained in: bf16 with
`bf16.bf16_master_weights_and_grads`, whose masters are still saved widened to fp32 above, exactly; absent:
"float32"; a load into a run of the other dtype converts, see `ds_zero._master_dtype`).

Model states (`<tag>/mp_rank_00_model_states.pt`, stage 3: `zero_pp_rank_0_mp_rank_00_model_states.pt`):
`"module"` (the module's state_dict: buffers and frozen parameters are taken from it; stage 3 stores empty
tensors for partitioned parameters), `"buffer_names"`, `"param_shapes"`, `"shared_params"`,
`"frozen_param_shapes"`, `"dp_world_size"`, `"zero_stage"`, plus client state. Only `"module"` is read by
the consolidation; the optimizer files alone rebuild every trainable parameter.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ds_zero._checkpoint.expert_ranges import ExpertRanges
from ds_zero._partition import Fragment

logger = logging.getLogger(__name__)

__all__ = [
    "FORMAT_VERSION",
    "FragmentIndex",
    "consolidate_fp32_params",
    "fill_partition",
    "fp32_param_values",
    "full_param_states",
    "is_partition_shaped",
    "partition_metadata",
    "validate_rank_state_dicts",
]

FORMAT_VERSION = 1

REQUIRED_KEYS = (
    "ds_zero_format",
    "zero_stage",
    "partition_count",
    "dp_rank",
    "single_partition_of_fp32_groups",
    "partitions",
    "base_optimizer_state",
)


def partition_metadata(
    group_index: int, numel: int, fragments: Iterable[Fragment], param_shapes: Mapping[str, Iterable[int]]
) -> dict[str, Any]:
    """The `"partitions"` entry of one flat partition (plain types only)."""
    frags = list(fragments)
    used = max((f.partition_start + f.numel for f in frags), default=0)
    names = {f.name for f in frags}
    return {
        "group_index": int(group_index),
        "numel": int(numel),
        "padding": int(numel - used),
        "fragments": [f.to_list() for f in frags],
        "param_shapes": {name: [int(d) for d in param_shapes[name]] for name in sorted(names)},
    }


def validate_rank_state_dicts(state_dicts: Sequence[Mapping[str, Any]]) -> int:
    """Check that `state_dicts` are all ranks of one ZeRO save, in rank order; returns their world size.

    Raises:
        ValueError: an empty list, a dict that is not in this format (names the missing keys), a version
            from a newer ds-zero, ranks missing, duplicated or out of order.
    """
    if not state_dicts:
        raise ValueError("no ZeRO optimizer state dicts given: pass every saved rank's dict, in rank order")
    for i, sd in enumerate(state_dicts):
        if not isinstance(sd, Mapping):
            raise TypeError(f"state_dicts[{i}] must be a dict, got {type(sd).__name__}")
        missing = [k for k in REQUIRED_KEYS if k not in sd]
        if missing:
            raise ValueError(
                f"state_dicts[{i}] is not a ds_zero partition state dict (missing keys {missing}); "
                "it may come from another tool or from a stage-0 checkpoint"
            )
        if int(sd["ds_zero_format"]) > FORMAT_VERSION:
            raise ValueError(
                f"state_dicts[{i}] has ds_zero_format={sd['ds_zero_format']}, newer than this ds-zero "
                f"reads ({FORMAT_VERSION}); upgrade ds-zero"
            )
    world = int(state_dicts[0]["partition_count"])
    ranks = [int(sd["dp_rank"]) for sd in state_dicts]
    if len(state_dicts) != world or ranks != list(range(world)):
        raise ValueError(
            f"expected the state dicts of all {world} ranks in order (dp_rank 0..{world - 1}), got "
            f"dp_ranks {ranks}; is a zero_pp_rank_*_optim_states.pt file missing?"
        )
    counts = {int(sd["partition_count"]) for sd in state_dicts}
    if len(counts) != 1:
        raise ValueError(
            f"the state dicts disagree on partition_count ({sorted(counts)}): they come from different saves"
        )
    return world


def is_partition_shaped(value: Any, partition_numel: int) -> bool:
    """Whether an optimizer-state value follows the partition's layout (vs a per-group scalar like `step`)."""
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == partition_numel


@dataclass(frozen=True)
class _Located:
    param_start: int
    numel: int
    rank: int
    k: int
    partition_start: int


class FragmentIndex:
    """Where every saved parameter slice lives, across all ranks' state dicts of one save.

    Args:
        state_dicts: every rank's optimizer state dict, in rank order (validated here).

    Attributes:
        world_size: partition count at save time.
        param_shapes: full shape of every partitioned parameter.
    """

    def __init__(self, state_dicts: Sequence[Mapping[str, Any]]) -> None:
        self.world_size = validate_rank_state_dicts(state_dicts)
        self.state_dicts = state_dicts
        self.param_shapes: dict[str, tuple[int, ...]] = {}
        self._by_name: dict[str, list[_Located]] = {}
        for rank, sd in enumerate(state_dicts):
            for k, meta in enumerate(sd["partitions"]):
                for name, shape in meta["param_shapes"].items():
                    self.param_shapes.setdefault(name, tuple(int(d) for d in shape))
                for item in meta["fragments"]:
                    f = Fragment.from_list(item)
                    self._by_name.setdefault(f.name, []).append(
                        _Located(f.param_start, f.numel, rank, k, f.partition_start)
                    )
        for located in self._by_name.values():
            located.sort(key=lambda loc: loc.param_start)
        self._expert_ranges = ExpertRanges(self.param_shapes)

    def shape_of(self, name: str) -> tuple[int, ...] | None:
        """The shape of parameter `name` in this save, or None when it has none. An AutoEP expert range saved
        under other ranges (another expert-parallel degree) has the shape of its rows (`expert_ranges`)."""
        shape = self.param_shapes.get(name)
        return shape if shape is not None else self._expert_ranges.shape(name)

    @property
    def names(self) -> list[str]:
        """Every partitioned parameter: those with fragments in first-seen order (rank 0's partitions
        first), then any named in `param_shapes` whose fragments are all missing (consolidation fails on them)."""
        return list(self._by_name) + [n for n in self.param_shapes if n not in self._by_name]

    def first_partition(self, name: str) -> tuple[int, int]:
        """`(rank, k)` of the partition holding the first saved slice of `name` (KeyError if none)."""
        loc = self._by_name[name][0]
        return loc.rank, loc.k

    def check_complete(self, name: str) -> None:
        """Raise ValueError unless the saved fragments of `name` tile it exactly."""
        numel = math.prod(self.param_shapes[name])
        pos = 0
        for loc in self._by_name.get(name, []):
            if loc.param_start != pos:
                break
            pos += loc.numel
        if pos != numel:
            raise ValueError(
                f"parameter {name!r} ({numel} elements) is not fully covered by the saved partitions "
                f"(covered up to element {pos}); a rank's optimizer-state file is missing or corrupt"
            )

    def copy_slice(
        self, dst: torch.Tensor, name: str, param_start: int, source: Callable[[int, int], torch.Tensor]
    ) -> None:
        """Fill `dst` (1-D) with elements `[param_start, param_start + dst.numel())` of parameter `name`.

        `source(rank, k)` returns the saved 1-D tensor of rank `rank`'s partition `k` to read from
        (the fp32 master values, or an optimizer-state tensor with the same layout).
        """
        if name not in self._by_name:
            pieces = self._expert_ranges.pieces(name, param_start, dst.numel())
            if pieces:  # an expert range this save holds under other ranges
                for saved, start, offset, length in pieces:
                    self.copy_slice(dst[offset : offset + length], saved, start, source)
                return
        want_lo, want_hi = param_start, param_start + dst.numel()
        filled = 0
        for loc in self._by_name.get(name, []):
            lo, hi = max(want_lo, loc.param_start), min(want_hi, loc.param_start + loc.numel)
            if lo >= hi:
                continue
            src = source(loc.rank, loc.k)
            src_lo = loc.partition_start + (lo - loc.param_start)
            dst[lo - want_lo : hi - want_lo].copy_(src[src_lo : src_lo + hi - lo])
            filled += hi - lo
        if filled != dst.numel():
            raise ValueError(
                f"elements [{want_lo}, {want_hi}) of parameter {name!r} are not in the saved "
                f"partitions (found {filled}); does the model match the checkpoint?"
            )


def fill_partition(
    dst: torch.Tensor, fragments: Iterable[Fragment], index: FragmentIndex, source: Callable[[int, int], torch.Tensor]
) -> None:
    """Build a partition of the current layout from a save with any world size (re-partitioning).

    `dst` is the new 1-D partition tensor; `fragments` says which parameter slices it holds; padding
    elements are zeroed. `source` is as in `FragmentIndex.copy_slice`.
    """
    dst.zero_()
    for f in fragments:
        if index.shape_of(f.name) is None:
            raise ValueError(
                f"parameter {f.name!r} is not in the checkpoint (saved parameters include "
                f"{index.names[:5]}...); was the model or its parameter naming changed?"
            )
        index.copy_slice(dst[f.partition_start : f.partition_start + f.numel], f.name, f.param_start, source)


def fp32_param_values(state_dicts: Sequence[Mapping[str, Any]], names: Iterable[str]) -> dict[str, torch.Tensor]:
    """The fp32 values of the parameters `names` (ZeRO names), each of its shape, from every rank's state dict
    of one save. An AutoEP expert range the save holds under other ranges is read from them (`expert_ranges`),
    so a rank's experts load at another expert-parallel degree.

    Raises:
        ValueError: a name the save does not hold, or missing fragments (names the parameter).
    """
    index = FragmentIndex(state_dicts)
    fp32 = [sd["single_partition_of_fp32_groups"] for sd in state_dicts]
    out: dict[str, torch.Tensor] = {}
    for name in names:
        shape = index.shape_of(name)
        if shape is None:
            raise ValueError(
                f"parameter {name!r} is not in the checkpoint (saved parameters include {index.names[:5]}...)"
            )
        value = torch.empty(math.prod(shape), dtype=torch.float32)
        index.copy_slice(value, name, 0, lambda rank, k: fp32[rank][k])
        out[name] = value.view(shape)
    return out


def consolidate_fp32_params(
    state_dicts: Sequence[Mapping[str, Any]], on_param: Callable[[str, int], None] | None = None
) -> dict[str, torch.Tensor]:
    """Full fp32 tensors of every partitioned parameter, rebuilt from all ranks' state dicts.

    Args:
        state_dicts: every rank's optimizer state dict of one save, in rank order.
        on_param: called as `on_param(name, numel)` after each parameter (progress reporting).

    Returns:
        `{name: fp32 tensor of the parameter's full shape}`, plus tied aliases from `"shared_params"`
        (the same tensor object under both names).

    Raises:
        ValueError: missing ranks or fragments (names the parameter).
    """
    index = FragmentIndex(state_dicts)
    fp32 = [sd["single_partition_of_fp32_groups"] for sd in state_dicts]
    out: dict[str, torch.Tensor] = {}
    for name in index.names:
        index.check_complete(name)
        shape = index.param_shapes[name]
        full = torch.empty(math.prod(shape), dtype=torch.float32)
        index.copy_slice(full, name, 0, lambda rank, k: fp32[rank][k])
        out[name] = full.view(shape)
        if on_param is not None:
            on_param(name, full.numel())
    for alias, name in dict(state_dicts[0].get("shared_params", {})).items():
        if name in out:
            out[alias] = out[name]
    return out


def full_param_states(index: FragmentIndex, parts: Sequence[Mapping[str, Any]], name: str) -> dict[str, Any]:
    """`fp32`, every partition-shaped optimizer-state tensor, and `step` of parameter `name`, unpartitioned
    (1-D), from every rank's state dict `parts` of one save indexed by `index`.

    Raises:
        ValueError: the saved fragments do not cover the parameter.
    """
    index.check_complete(name)
    numel = math.prod(index.param_shapes[name])

    def gather(source: Callable[[int, int], torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(numel, dtype=dtype)
        index.copy_slice(out, name, 0, source)
        return out

    rank, k = index.first_partition(name)  # the partition of its first slice says which states there are
    state = parts[rank]["base_optimizer_state"]["state"].get(k, {})
    out: dict[str, Any] = {"fp32": gather(lambda r, k: parts[r]["single_partition_of_fp32_groups"][k], torch.float32)}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() == 1:
            out[key] = gather(lambda r, k, key=key: parts[r]["base_optimizer_state"]["state"][k][key], value.dtype)
        else:
            out.setdefault(key, value)
    return out
