"""Reading a universal checkpoint (DeepSpeed's `ds_to_universal` layout) as one format-1 partition state dict.

A universal checkpoint keeps each parameter whole (`zero/<name>/fp32.pt`, one file per optimizer state),
so it is exactly a ZeRO save at world size 1: `load_universal_partitions` builds that save's single
rank dict (one flat partition per param group, the parameters back to back in the model-states file's
`param_shapes` order), and ds-zero's loaders re-partition it onto any world size and any stage, as they
do any checkpoint. Both variants DeepSpeed writes are read: stage-1/2 files (`{"param": full tensor,
...}` and `step.pt`) and stage-3 ones (bare flat tensors, the step in `optimizer_state.pt`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

import ds_comm
from ds_zero._checkpoint.format import FORMAT_VERSION, partition_metadata
from ds_zero._checkpoint.partition_files import deepspeed_model_states_file
from ds_zero._partition import Fragment

__all__ = ["ShardTransform", "load_universal_partitions", "universal_model_states_file"]

#: `(name, whole) -> the part of parameter name this rank holds` (see `load_universal_partitions`).
ShardTransform = Callable[[str, torch.Tensor], torch.Tensor]


def universal_model_states_file(folder: str | os.PathLike[str]) -> Path:
    """The model-states file copied into a universal checkpoint (`mp_rank_00_...` or stage 3's rank-0 one).

    Raises:
        FileNotFoundError: none there (names the folder).
    """
    path = deepspeed_model_states_file(folder)
    if path is None:
        raise FileNotFoundError(
            f"{folder} holds no mp_rank_00_model_states.pt or zero_pp_rank_0_mp_rank_00_model_states.pt: "
            "not a universal checkpoint folder (ds_to_universal's --output_folder)"
        )
    return path


def _read_state_file(path: Path) -> tuple[Any, torch.Tensor]:
    """(what one universal state file holds, its tensor: the `param` entry or the bare tensor).

    Raises:
        FileNotFoundError: the file is missing (the checkpoint is incomplete).
        ds_comm.CheckpointFileError: it holds no tensor.
    """
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the universal checkpoint is incomplete")
    loaded = ds_comm.load_checkpoint_file(path)
    value = loaded.get("param") if isinstance(loaded, Mapping) else loaded
    if not isinstance(value, torch.Tensor):
        raise ds_comm.CheckpointFileError(f"{path}: holds no tensor (a 'param' entry or a bare tensor)")
    return loaded, value


def _tensor(
    path: Path,
    shape: list[int],
    *,
    name: str,
    saved_shape: list[int] | None = None,
    transform: ShardTransform | None = None,
) -> torch.Tensor:
    """The flat value stored in one state file (`{"param": ...}` or a bare tensor), through `transform`."""
    loaded, value = _read_state_file(path)
    whole = saved_shape if transform is not None and saved_shape is not None else shape
    if isinstance(loaded, Mapping) and loaded.get("vocab_tensor") and value.dim() == 2 and value.shape[0] < whole[0]:
        value = torch.nn.functional.pad(value, (0, 0, 0, whole[0] - value.shape[0]))  # DeepSpeed strips vocab padding
    if transform is not None:
        if saved_shape is not None and value.numel() == math.prod(saved_shape):
            value = value.reshape(saved_shape)  # stage 3 stores the bare flat tensor
        value = transform(name, value.detach())
    numel = math.prod(shape)
    if value.numel() != numel:
        raise ValueError(f"{path}: {value.numel()} elements, the model's parameter has shape {shape} ({numel})")
    return value.detach().reshape(-1)


def _whole_param_shapes(root: Path, states: Mapping[str, Any]) -> list[dict[str, list[int]]]:
    """Per param group, name -> whole shape of every parameter of the universal checkpoint in `root`.

    The model-states file's `param_shapes` are the saving rank's: a tensor-parallel save
    (`checkpoint_parallel_dimensions.tp_degree` > 1, as DeepSpeed and ds record it) has rank 0's shards
    there, while `fp32.pt` holds the merged whole. For such a checkpoint the shapes are those of the
    `fp32.pt` files.
    """
    groups = [{n: [int(d) for d in shp] for n, shp in group.items()} for group in states.get("param_shapes") or []]
    dims = states.get("checkpoint_parallel_dimensions") or {}
    if int(dims.get("tp_degree", 1) or 1) == 1:
        return groups
    out = []
    for group in groups:
        whole = {}
        for name in group:
            whole[name] = list(_read_state_file(root / "zero" / name / "fp32.pt")[1].shape)
        out.append(whole)
    return out


def _state_keys(folder: Path) -> list[str]:
    return sorted(p.stem for p in folder.glob("*.pt") if p.stem not in ("fp32", "step"))


def load_universal_partitions(
    folder: str | os.PathLike[str],
    *,
    param_shapes: Sequence[Mapping[str, Sequence[int]]] | None = None,
    model_dtype: torch.dtype | None = None,
    transform: ShardTransform | None = None,
    source_names: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """The universal checkpoint in `folder` as the single-rank format-1 state dict list ds-zero loads.

    Args:
        folder: the universal checkpoint's directory (`ds_to_universal`'s `--output_folder`).
        param_shapes: per param group, name -> shape of the parameters to read, in the loading
            optimizer's order (`zero_param_shapes(optimizer, module)`). Default: the model-states
            file's `param_shapes`, i.e. the model that was saved (whole: for a tensor-parallel save,
            whose file records rank 0's shards, the shapes of the `fp32.pt` files). A pipeline stage
            passes its own parameters: a pipeline's universal checkpoint holds every stage's parameters, and its
            model-states file describes stage 0 only.
        model_dtype: the training dtype recorded in the partition (default: the dtype of the
            model-states file's module tensors, float32 when it has none).
        transform: `transform(name, whole)` returns the part of parameter `name` this rank holds, for
            the fp32 value and every optimizer state alike (a tensor-parallel rank's shard: universal
            files hold whole parameters). `whole` has the saved whole shape; the result must have
            `param_shapes[name]`'s number of elements.
        source_names: name in `param_shapes` -> the parameter folder (`zero/<folder>/`) it is read from;
            default the name itself. An AutoEP expert range (`<prefix>.w1@experts2:4`) reads its layer's whole
            expert tensor (`<prefix>.w1`), which `transform` cuts.

    Raises:
        FileNotFoundError: a missing model-states, `zero/optimizer_state.pt` or parameter file (names it).
        ValueError: a file whose size disagrees with `param_shapes`, or parameters of one group with
            different optimizer states.
        ds_comm.CheckpointFileError: a file that cannot be read.
    """
    root = Path(folder)
    states_file = universal_model_states_file(root)
    states = ds_comm.load_checkpoint_file(states_file)
    ds_comm.check_deepspeed_version(states.get("ds_version"), states_file)
    saved = _whole_param_shapes(root, states)
    saved_shapes = {n: shp for group in saved for n, shp in group.items()}
    if param_shapes is None:
        param_shapes = saved
        if not param_shapes:
            raise ValueError(f"{states_file}: no param_shapes; it does not describe a ZeRO checkpoint")
    shapes_by_group = [{n: [int(d) for d in s] for n, s in group.items()} for group in param_shapes]
    common_file = root / "zero" / "optimizer_state.pt"
    if not common_file.is_file():
        raise FileNotFoundError(f"{common_file} is missing: it holds the optimizer's global state")
    common = ds_comm.load_checkpoint_file(common_file)
    groups = list(common.get("param_groups") or [])
    if len(groups) != len(shapes_by_group):
        raise ValueError(f"{common_file} has {len(groups)} param groups, the loading model has {len(shapes_by_group)}")
    stage3_step = None
    if "optimizer_state_dict" in common:  # stage 3's common file: the step lives in the base state
        stage3_step = (common["optimizer_state_dict"].get("state") or {}).get(0, {}).get("step")
    fp32, metas, base_state = [], [], {}
    module = states.get("module") or {}
    dtype = model_dtype or next(
        (v.dtype for n in shapes_by_group[0] if isinstance(v := module.get(n), torch.Tensor) and v.is_floating_point()),
        torch.float32,
    )
    for g, shapes in enumerate(shapes_by_group):
        flats: dict[str, list[torch.Tensor]] = {}
        frags, at, steps = [], 0, {}
        keys = None
        for name, shape in shapes.items():
            source = source_names.get(name, name) if source_names else name
            pdir = root / "zero" / source
            names = _state_keys(pdir)
            if keys is None:
                keys = names
            elif names != keys:
                raise ValueError(f"{pdir} holds optimizer states {names}, other parameters of group {g} hold {keys}")
            for key in ["fp32", *names]:
                value = _tensor(
                    pdir / f"{key}.pt", shape, name=name, saved_shape=saved_shapes.get(source), transform=transform
                )
                flats.setdefault(key, []).append(value)
            if (pdir / "step.pt").is_file():
                value = ds_comm.load_checkpoint_file(pdir / "step.pt")
                steps[float(value)] = value
            numel = math.prod(shape)
            frags.append(Fragment(name, 0, numel, at))
            at += numel
        if len(steps) > 1:
            raise ValueError(f"the parameters of group {g} in {root / 'zero'} have different steps {sorted(steps)}")
        fp32.append(torch.cat(flats.pop("fp32")).float())
        metas.append(partition_metadata(g, at, frags, shapes))
        state: dict[str, Any] = {key: torch.cat(parts) for key, parts in flats.items()}
        step = next(iter(steps.values())) if steps else stage3_step
        if step is not None:
            state = {"step": step, **state}
        base_state[g] = state
    scaler = common.get("loss_scaler")
    if isinstance(scaler, Mapping):  # a ds save's common file keeps the loss scaler's state dict
        scaler = dict(scaler)
    return [
        {
            "ds_zero_format": FORMAT_VERSION,
            "zero_stage": int(common.get("zero_stage", 1)),
            "partition_count": 1,
            "dp_rank": 0,
            "model_dtype": str(dtype).removeprefix("torch."),
            "offload_optimizer": "none",
            "single_partition_of_fp32_groups": fp32,
            "partitions": metas,
            "base_optimizer_state": {
                "state": base_state,
                "param_groups": [{**group, "params": [g]} for g, group in enumerate(groups)],
            },
            "loss_scaler": scaler
            if isinstance(scaler, dict)
            else scaler.state_dict()
            if hasattr(scaler, "state_dict")
            else {"cur_scale": 1.0, "dynamic": False},
            "dynamic_loss_scale": bool(common.get("dynamic_loss_scale", False)),
            "overflow": bool(common.get("overflow", False)),
            "clip_grad": float(common.get("clip_grad", 0.0) or 0.0),
            "shared_params": dict(states.get("shared_params") or {}),
            "frozen_param_shapes": {k: list(v) for k, v in (states.get("frozen_param_shapes") or {}).items()},
        }
    ]
