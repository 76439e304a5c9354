"""Writing DeepSpeed's universal checkpoint: every parameter's full fp32 value and optimizer state on its own.

A ZeRO checkpoint stores flat per-rank partitions, so it loads only at the world size that wrote it
(ds re-partitions, DeepSpeed does not). DeepSpeed's answer is the universal layout its
`ds_to_universal` writes from a tag directory (`--input_folder`) into `--output_folder`:

* `zero/<param>/fp32.pt`, `exp_avg.pt`, `exp_avg_sq.pt` (one file per optimizer-state tensor): from a
  stage-1/2 save `{"cat_dim": 0, "param": full tensor}` (full shape), plus `step.pt` (the step value);
  from a stage-3 save the bare flat tensor and no step file (the step is in `optimizer_state.pt`).
  Stage 1/2 also give every module entry without optimizer state (buffers) `{"param": fp32 copy}`.
* `zero/optimizer_state.pt`: data-parallel rank 0's optimizer state minus the partitions (stage 1/2),
  or all of it (stage 3), plus `param_groups`.
* the model-states files, copied; and `latest_universal` next to the output folder, naming it.

`convert_to_universal` writes that layout, tensor for tensor what DeepSpeed 0.19.8's converter
writes, from DeepSpeed's checkpoints and from ds's own (which are first written in DeepSpeed's layout
by `to_deepspeed`, so both go through one path).

[Note: pipeline checkpoints] A pipeline checkpoint (`layer_XX-model_states.pt` files present) has one
`mp_rank_{stage:02d}_model_states.pt` per stage, whose `param_shapes` name that stage's parameters
(by global layer index, `2.weight`), and per stage the optimizer files of its data-parallel ranks
(`zero_pp_rank_{dp}_mp_rank_{stage:02d}_optim_states.pt`). Each stage's partitions are merged on their
own; together the stages give every parameter once (a tied parameter held by several stages is taken
from the last one, as DeepSpeed's converter does, unless it matches
`pipeline_replicated_parameter_patterns`: then the first stage's copy). Every stage's model-states
file is copied; `optimizer_state.pt` is stage 0's. A pipeline that is tensor-parallel too (`tp_degree`
> 1 in `checkpoint_parallel_dimensions`) has `stages x tp_degree` files, stage-major
(`mp_rank = stage * tp_degree + tp_rank`); each stage's tensor-parallel ranks merge by the categories.

Tensor-parallel checkpoints (several `mp_rank` files without layer files, ZeRO 1/2) merge each
parameter's slices as their `universal_checkpoint_info` says ([Note: merging tensor-parallel slices]
in `universal_categories.py`); one without that info is refused, as the cut of its shards is unknown.
`optimizer_state.pt` is tensor-parallel rank 0's, and every rank's model-states file is copied.

[Note: ZeRO-3 and AutoTP] A ZeRO-3 checkpoint of a tensor-parallel model has one model-states file per
(data-parallel, tensor-parallel) rank, `zero_pp_rank_{dp}_mp_rank_{tp:02d}_model_states.pt`, each
`param_shapes` that rank's shard shapes. Each tensor-parallel rank's partitions are merged over its
data-parallel ranks, then the ranks' slices merge by the categories of the `universal_checkpoint_info`
(`{"cat_dim": ..., "param": ...}` files, as at stage 1/2, and no `step.pt`: the steps stay in
`optimizer_state.pt`), as DeepSpeed 0.19.8's converter does; without that info every parameter would
be taken as cut along dim 0, so one without it is refused, as at stage 1/2.

[Note: AutoEP] A save of a model with AutoEP layers (`ds_autoep_layers` in its model-states file), at any
ZeRO stage, holds each expert-parallel rank's stacked experts under a name with their range; its universal
checkpoint joins them into whole `[num_experts, ...]` tensors marked as DeepSpeed's expert entries
(`universal_autoep.py`), so it loads at another world size and another `autoep_size`.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

import ds_comm
from ds_comm.checkpoint_files import deepspeed_pickle_names
from ds_zero._checkpoint.deepspeed_convert import convert_to_deepspeed
from ds_zero._checkpoint.deepspeed_format import is_deepspeed_state_dict
from ds_zero._checkpoint.format import FragmentIndex, full_param_states
from ds_zero._checkpoint.io import find_model_states_file
from ds_zero._checkpoint.partition_files import load_partition_state_dicts, optim_files
from ds_zero._checkpoint.universal_autoep import autoep_layers, write_autoep_universal
from ds_zero._checkpoint.universal_categories import UNIVERSAL_INFO_KEY, Categories

__all__ = ["UNIVERSAL_INFO_KEY", "convert_to_universal"]

logger = logging.getLogger(__name__)

_UNIVERSAL_VERSION = 0.4  # what DeepSpeed 0.19.8 injects with --inject_missing_state
_STAGE12_SHARDED = ("base_optimizer_state", "param_slice_mappings", "single_partition_of_fp32_groups")
_PIPELINE_REPLICATED = "pipeline_replicated_parameter_patterns"
_LAYER_FILE = re.compile(r"layer_(\d+)-model_.*")  # DeepSpeed's test for a pipeline checkpoint


def _model_states_files(folder: Path, stage: int) -> tuple[list[Path], bool, int, int]:
    """The model-states files DeepSpeed's converter copies, in model-parallel rank order (stage 1/2:
    `mp_rank_*`; stage 3: every `*_model_states.pt` but MoE expert files), whether the checkpoint is a
    pipeline's (one `mp_rank` file per stage, see [Note: pipeline checkpoints]), and the number of
    model-parallel ranks, and the tensor-parallel degree (without pipeline every model-parallel rank is a
    tensor-parallel rank, see [Note: merging tensor-parallel slices])."""
    if stage == 3:
        files = [p for p in folder.glob("*_model_states.pt") if not re.match(r"layer_.*_expert_", p.name)]
    else:
        files = list(folder.glob("mp_rank_*_model_states.pt"))
    files.sort()
    if not files:
        raise FileNotFoundError(f"no model-states files in {folder}: not a ZeRO checkpoint tag directory")
    dims = ds_comm.load_checkpoint_file(files[0], mmap=True).get("checkpoint_parallel_dimensions") or {}
    # the layer files, or (a converted copy without them) the recorded stage count
    pipeline = any(_LAYER_FILE.fullmatch(p.name) for p in folder.iterdir()) or int(dims.get("pp_degree", 1) or 1) > 1
    mp_ranks = sorted({int(m.group(1)) for p in files if (m := re.search(r"mp_rank_(\d+)", p.name))})
    if mp_ranks != list(range(len(mp_ranks))):
        what = "pipeline stages'" if pipeline else "tensor-parallel ranks'"
        raise ValueError(f"{folder}: the {what} model-states files cover model-parallel ranks {mp_ranks}")
    tp_degree = len(mp_ranks)
    if pipeline:
        if stage > 1:
            raise ValueError(f"{folder} is a pipeline checkpoint at ZeRO stage {stage}: pipelines take stage 0 or 1")
        tp_degree = int(dims.get("tp_degree", 1) or 1)
        if len(mp_ranks) % tp_degree:
            raise ValueError(
                f"{folder}: {len(mp_ranks)} model-parallel ranks are not whole pipeline stages of tensor-parallel "
                f"degree {tp_degree}"
            )
    return files, pipeline, len(mp_ranks), tp_degree


def _check_universal_info(states: Mapping[str, Any], path: Path, inject: bool) -> dict[str, Any]:
    info = states.get(UNIVERSAL_INFO_KEY)
    if info is None:
        if not inject:
            raise ValueError(
                f"{path} has no {UNIVERSAL_INFO_KEY!r} (DeepSpeed's engine writes none; Megatron-style clients "
                "do): pass --inject_missing_state to convert it with the defaults, as DeepSpeed's converter asks"
            )
        info = {"universal_checkpoint_version": _UNIVERSAL_VERSION}
    return dict(info)


def convert_to_universal(
    input_folder: str | os.PathLike[str],
    output_folder: str | os.PathLike[str],
    *,
    num_extract_workers: int = 4,
    num_merge_workers: int = 2,
    keep_temp_folder: bool = False,
    strict: bool = True,
    inject_missing_state: bool = False,
) -> Path:
    """Write the universal checkpoint of the ZeRO checkpoint tag directory `input_folder` into `output_folder`.

    Args:
        input_folder: a tag directory (`<save_dir>/global_step100`) of DeepSpeed's or ds's, ZeRO stage 1-3.
        output_folder: the universal checkpoint's directory; `latest_universal` naming it is written
            next to it (in its parent), last.
        num_extract_workers: accepted for DeepSpeed's interface (checked >= 1); the rank files are read one
            after another, as `ds_comm.load_checkpoint_file`'s allow-list is process-wide and not thread-safe.
        num_merge_workers: threads writing the per-parameter files.
        keep_temp_folder: keep `output_folder/tmp` (a ds checkpoint's DeepSpeed layout, written there first).
        strict: fail when a pattern of the checkpoint's `universal_checkpoint_info` matches no parameter.
        inject_missing_state: a stage-1/2 checkpoint without `universal_checkpoint_info` (any engine
            checkpoint) is converted with the defaults; without it, that is an error, as in DeepSpeed.

    Returns:
        `output_folder`.

    Raises:
        FileNotFoundError: not a ZeRO checkpoint tag directory (stage 0 has no optimizer partitions).
        ValueError: a layout this converter does not handle (an AutoEP save folded with tensor parallelism,
            or one whose expert fragments carry no expert range), missing universal info, unused patterns.
        ds_comm.CheckpointFileError: a file that cannot be read (names it).
    """
    if num_extract_workers < 1 or num_merge_workers < 1:
        raise ValueError(f"worker counts must be >= 1, got {num_extract_workers} and {num_merge_workers}")
    src, out = Path(input_folder), Path(output_folder)
    if not src.is_dir():
        raise FileNotFoundError(f"input folder {src} does not exist")
    temp = out / "tmp"
    states_file = find_model_states_file(src)
    states = ds_comm.load_checkpoint_file(states_file) if states_file is not None else {}
    try:
        if states_file is not None and autoep_layers(states):  # expert tensors joined whole ([Note: AutoEP])
            write_autoep_universal(src, out, states_file, states)
        else:
            first = ds_comm.load_checkpoint_file(optim_files(src)[0])
            if not is_deepspeed_state_dict(first["optimizer_state_dict"]):
                # a ds checkpoint: DeepSpeed's layout first
                src = convert_to_deepspeed(src.parent, temp, tag=src.name)
                first = ds_comm.load_checkpoint_file(optim_files(src)[0])
            _write(
                src,
                out,
                first["optimizer_state_dict"],
                num_extract_workers,
                num_merge_workers,
                strict,
                inject_missing_state,
            )
    finally:
        if not keep_temp_folder:
            shutil.rmtree(temp, ignore_errors=True)
    ds_comm.atomic_write_text(out.parent / "latest_universal", out.name)
    return out


def _write(
    src: Path, out: Path, rank0: Mapping[str, Any], extract: int, merge: int, strict: bool, inject: bool
) -> None:
    stage = int(rank0["zero_stage"])
    model_files, pipeline, mp_degree, tp_degree = _model_states_files(src, stage)
    del extract  # reading stays serial: the restricted unpickler's allow-list is process-wide state
    states = ds_comm.load_checkpoint_file(model_files[0])
    if not pipeline and tp_degree > 1 and UNIVERSAL_INFO_KEY not in states:
        raise ValueError(
            f"{model_files[0]} is tensor-parallel rank 0 of {tp_degree} but has no {UNIVERSAL_INFO_KEY!r}: "
            "nothing says how its parameters are cut (replicated, row or column), so the shards cannot be "
            "merged (a save by an older ds, or a client that does not record it)"
        )
    # Stage 3 without tensor parallelism writes bare flat tensors (no categories); with it, the slices of
    # every tensor-parallel rank merge by the categories, as at stage 1/2 ([Note: ZeRO-3 and AutoTP]).
    merged = stage < 3 or tp_degree > 1
    info = _check_universal_info(states, model_files[0], inject or stage == 3) if merged else {}
    categories = Categories(info) if merged else None
    zero = out / "zero"
    zero.mkdir(parents=True, exist_ok=True)
    replicated = list(info.get(_PIPELINE_REPLICATED, []))
    # A pipeline's stages hold different parameters (merged one stage after another); tensor-parallel
    # ranks hold slices of the same ones (merged together). Files are stage-major: stage * tp + tp_rank.
    groups = [list(range(at, at + tp_degree)) for at in range(0, mp_degree, tp_degree)]
    for mp_ranks in groups:
        shards = [_Shard(load_partition_state_dicts(src, mp_rank=r)) for r in mp_ranks]
        _check_same_names(src, shards)
        first = mp_ranks[0]
        names = [n for n in shards[0].index.names if first == 0 or not any(re.match(p, n) for p in replicated)]
        write = functools.partial(_write_param, zero, shards, categories, stage < 3)
        with ThreadPoolExecutor(max_workers=merge) as pool:
            list(pool.map(write, names))
    if categories is not None:
        if categories.unused:
            message = f"unused patterns {sorted(categories.unused)} of {UNIVERSAL_INFO_KEY} while converting"
            if strict:
                raise ValueError(message)
            logger.warning(message)
        for path in model_files if stage < 3 else ():  # buffers, and parameters ZeRO holds no state for
            module = (  # (a pipeline's module is None; a ZeRO-3 module holds no weights)
                states.get("module") if path == model_files[0] else ds_comm.load_checkpoint_file(path).get("module")
            )
            for name, value in (module or {}).items():
                if isinstance(value, torch.Tensor) and not (zero / name / "fp32.pt").is_file():
                    (zero / name).mkdir(exist_ok=True)
                    ds_comm.atomic_save({"param": value.float()}, zero / name / "fp32.pt")
    if stage < 3:
        common = {k: v for k, v in rank0.items() if k not in _STAGE12_SHARDED}
        common["param_groups"] = rank0["base_optimizer_state"]["param_groups"]
    else:
        common = dict(rank0)
        common["param_groups"] = rank0["optimizer_state_dict"]["param_groups"]
    with deepspeed_pickle_names():
        ds_comm.atomic_save(common, zero / "optimizer_state.pt")
    for path in model_files:
        shutil.copy2(path, out / path.name)


class _Shard:
    """One model-parallel rank's ZeRO partitions (every data-parallel rank's) and where each slice lives."""

    def __init__(self, parts: list[dict[str, Any]]) -> None:
        self.parts = parts
        self.index = FragmentIndex(parts)


def _check_same_names(src: Path, shards: Sequence[_Shard]) -> None:
    names = set(shards[0].index.names)
    for rank, shard in enumerate(shards[1:], start=1):
        if set(shard.index.names) != names:
            diff = sorted(names.symmetric_difference(shard.index.names))
            raise ValueError(
                f"{src}: tensor-parallel ranks 0 and {rank} hold different parameters ({diff[:5]}): the "
                "checkpoint's ranks come from different models"
            )


def _write_param(
    zero: Path, shards: Sequence[_Shard], categories: Categories | None, with_step: bool, name: str
) -> None:
    """The state files of parameter `name` (`fp32.pt`, one per optimizer state, and `step.pt` when
    `with_step`: stage 1/2), its slices on every tensor-parallel rank in `shards` merged (one shard: no
    tensor parallelism)."""
    states = [full_param_states(s.index, s.parts, name) for s in shards]
    shapes = [s.index.param_shapes[name] for s in shards]
    folder = zero / name
    folder.mkdir(exist_ok=True)
    steps = [state.pop("step", None) for state in states]
    if any(not _same(steps[0], other) for other in steps[1:]):
        raise ValueError(f"parameter {name!r}: the tensor-parallel ranks hold different steps {steps}")
    for key, value in states[0].items():
        if not isinstance(value, torch.Tensor):
            continue
        if categories is None:  # stage 3: the bare flat tensor
            payload: Any = value.requires_grad_(key == "fp32")  # as DeepSpeed's: its fp32 masters require grad
        else:
            slices = [state[key].view(shape) for state, shape in zip(states, shapes, strict=True)]
            payload = categories.payload(name, slices, key)
            payload["param"].requires_grad_(key == "fp32")
        ds_comm.atomic_save(payload, folder / f"{key}.pt")
    if with_step and steps[0] is not None:
        ds_comm.atomic_save(steps[0], folder / "step.pt")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a, b)
    return bool(a == b)
