"""Consolidate a ZeRO checkpoint (any stage, any world size) into one fp32 state_dict for `model.load_state_dict`.

Command line (installed as `ds-zero-to-fp32`)::

    ds-zero-to-fp32 CHECKPOINT_DIR OUTPUT_DIR [--max_shard_size 5GB] [--safe_serialization] [-t TAG]
                    [--exclude_frozen_parameters] [-q]

`CHECKPOINT_DIR` is the save directory holding `latest` (or a tag directory). `OUTPUT_DIR` receives
`pytorch_model.bin` (or `model.safetensors`), or numbered shards and an index when the weights exceed
`--max_shard_size`: DeepSpeed's arguments and layout. A progress bar on stderr follows the consolidation.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import ds_comm
from ds_zero._checkpoint.autoep_zero3 import refuse_autoep_zero3
from ds_zero._checkpoint.format import FragmentIndex, consolidate_fp32_params
from ds_zero._checkpoint.hf_shards import parse_shard_size, write_state_dict_dir
from ds_zero._checkpoint.io import (
    MODEL_STATES_FILE,
    find_model_states_file,
    load_optim_state_dicts,
    resolve_checkpoint_dir,
)
from ds_zero._checkpoint.model_states import read_frozen_params, with_shared
from ds_zero._checkpoint.progress import ProgressBar

logger = logging.getLogger(__name__)

__all__ = [
    "convert_zero_checkpoint_to_fp32_state_dict",
    "convert_zero_checkpoint_to_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "get_model_state_files",
    "get_optim_files",
    "load_state_dict_from_zero_checkpoint",
    "main",
    "parse_model_states",
    "zero_model_state",
]


def _natural_key(path: str) -> list[int | str]:
    # rank 10 after rank 9, as ranks are numbered: split the name into text and integer runs.
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path)]


def _files_ending(checkpoint_dir: str | os.PathLike[str], suffix: str) -> list[str]:
    root = Path(checkpoint_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"checkpoint directory {checkpoint_dir} does not exist")
    found = sorted((str(p) for p in root.iterdir() if p.name.endswith(suffix)), key=_natural_key)
    if not found:
        raise FileNotFoundError(f"no '*{suffix}' files in {checkpoint_dir}")
    return found


def get_optim_files(checkpoint_dir: str | os.PathLike[str]) -> list[str]:
    """Paths of the `*_optim_states.pt` files in a tag directory, ranks in numeric order (DeepSpeed's lister).

    Raises:
        FileNotFoundError: the directory does not exist or holds no such file.
    """
    return _files_ending(checkpoint_dir, "optim_states.pt")


def get_model_state_files(checkpoint_dir: str | os.PathLike[str]) -> list[str]:
    """Paths of the `*_model_states.pt` files in a tag directory, ranks in numeric order.

    Raises:
        FileNotFoundError: the directory does not exist or holds no such file.
    """
    return _files_ending(checkpoint_dir, "_model_states.pt")


@dataclasses.dataclass
class zero_model_state:  # noqa: N801 - DeepSpeed's name
    """What `parse_model_states` reads from one model-states file (DeepSpeed's record)."""

    buffers: dict[str, torch.Tensor]
    param_shapes: list[dict[str, Any]]
    shared_params: list[list[str]]
    ds_version: Any
    frozen_param_shapes: dict[str, Any] | None
    frozen_param_fragments: dict[str, torch.Tensor] | None


def _raise_if_autoep_zero3_partitioned_checkpoint(model_files: Sequence[str | os.PathLike[str]]) -> None:
    """Refuse model-states files of an AutoEP save at ZeRO stage 3 (DeepSpeed's name; `_checkpoint.autoep_zero3`).

    Raises:
        AutoEPZero3CheckpointError: one is (a NotImplementedError, as DeepSpeed's).
    """
    for file in model_files:
        refuse_autoep_zero3(ds_comm.load_checkpoint_file(file), file)


def parse_model_states(files: Sequence[str | os.PathLike[str]]) -> list[zero_model_state]:
    """Each model-states file's buffers (as fp32), parameter shapes, tied names, version and frozen parameters
    (DeepSpeed's reader, which its consolidation starts from).

    Raises:
        AutoEPZero3CheckpointError: an AutoEP save at ZeRO stage 3.
        ValueError: a file that is not a model-states file (no `buffer_names`).
    """
    out = []
    for file in files:
        states = ds_comm.load_checkpoint_file(file)
        refuse_autoep_zero3(states, file)
        if "buffer_names" not in states:
            raise ValueError(f"{file} is not a model state checkpoint")
        names = set(states["buffer_names"])
        out.append(
            zero_model_state(
                buffers={k: v.float() for k, v in (states.get("module") or {}).items() if k in names},
                param_shapes=states["param_shapes"],
                shared_params=[[k, v] for k, v in (states.get("shared_params") or {}).items()],
                ds_version=states.get("ds_version"),
                frozen_param_shapes=states.get("frozen_param_shapes"),
                frozen_param_fragments=states.get("frozen_param_fragments"),
            )
        )
    return out


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
    *,
    progress: bool = False,
) -> dict[str, torch.Tensor]:
    """Every parameter in fp32, rebuilt from all ranks' partitions, plus buffers from the model states.

    Args:
        checkpoint_dir: the save directory holding `latest` (or a tag directory).
        tag: the checkpoint tag (default: the one in `latest`).
        exclude_frozen_parameters: leave out parameters that had `requires_grad=False`.
        progress: draw a progress bar on stderr.

    Returns:
        A state_dict in the module's key order when the model-states file is there: trainable
        parameters in fp32 from the partitions, frozen parameters (cast to fp32; from every rank's
        `frozen_param_fragments` where a DeepSpeed stage-3 file holds placeholders) and buffers (dtype
        kept) from the model-states files; a tied parameter is its twin's tensor (`shared_params`).

    Raises:
        FileNotFoundError: no such checkpoint, or no optimizer-state files (a stage-0 checkpoint).
        ValueError: a rank's file is missing or does not cover its parameters.
        NotImplementedError: an AutoEP checkpoint saved at ZeRO stage 3 (`_checkpoint.autoep_zero3`).
    """
    ckpt = resolve_checkpoint_dir(checkpoint_dir, tag)
    states_file = find_model_states_file(ckpt)
    states = ds_comm.load_checkpoint_file(states_file) if states_file is not None else None
    if states is not None:
        refuse_autoep_zero3(states, states_file)
    state_dicts = load_optim_state_dicts(ckpt)
    index = FragmentIndex(state_dicts)
    total = sum(math.prod(shape) for shape in index.param_shapes.values())
    bar = ProgressBar(total, label=f"zero_to_fp32 {ckpt.name}", enabled=progress)
    params = consolidate_fp32_params(state_dicts, on_param=lambda _name, numel: bar.update(numel))
    bar.close()
    if states_file is None or states is None:
        logger.warning("no model-states file in %s: buffers and frozen parameters are not included", ckpt)
        return params
    module_sd = states.get("module") or {}
    # Frozen parameters: whole in the module (ds's layout, DeepSpeed's stage 1/2), or only as fragments
    # (DeepSpeed's stage 3, sliced over every rank's model-states file; `_checkpoint.model_states`).
    frozen_names = {*(state_dicts[0].get("frozen_param_shapes") or {}), *(states.get("frozen_param_shapes") or {})}
    buffers = set(states.get("buffer_names") or [])
    frozen = {}
    if states.get("frozen_param_fragments") and not exclude_frozen_parameters:  # absent: whole in the module
        one_file = states_file.name == MODEL_STATES_FILE
        frozen = read_frozen_params(ckpt, states=[states] if one_file else None)
    shared = states.get("shared_params") or {}
    out: dict[str, torch.Tensor] = {}
    for name, value in module_sd.items():
        stored = shared.get(name, name)
        if stored in params:
            out[name] = params[stored]
        elif stored not in frozen_names and (name in buffers or "buffer_names" not in states):
            out[name] = value  # a buffer
        elif exclude_frozen_parameters:
            continue
        else:  # a frozen parameter; an empty placeholder without fragments is not in this checkpoint
            value = frozen.get(stored, value)
            if isinstance(value, torch.Tensor) and value.numel() > 0:
                out[name] = value.float() if value.is_floating_point() else value
    for name, value in params.items():
        out.setdefault(name, value)
    return with_shared(out, {a: s for a, s in shared.items() if a in out})


def _torch_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}: use one of {', '.join(sorted(_DTYPES))} (or a torch.dtype)")
    return _DTYPES[name]


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
_FILE_SUFFIXES = (".bin", ".pt", ".pth", ".safetensors")


def _check_output_dir(output_dir: str | os.PathLike[str]) -> Path:
    out = Path(output_dir)
    if out.suffix in _FILE_SUFFIXES and not out.is_dir():
        raise ValueError(
            f"output_dir {out} looks like a file name: the second argument is the directory that receives "
            f"pytorch_model.bin (or model.safetensors, or shards and an index), as in DeepSpeed since 0.14; "
            f"pass {out.parent} or another directory"
        )
    if out.exists() and not out.is_dir():
        raise ValueError(f"output_dir {out} is an existing file; give a directory to write the weights into")
    return out


def _cast(state_dict: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Floating-point tensors in `dtype`; tensors that were one object (tied weights) stay one."""
    cast: dict[int, torch.Tensor] = {}
    out = {}
    for name, value in state_dict.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
            value = cast.setdefault(id(value), value.to(dtype))
        out[name] = value
    return out


def convert_zero_checkpoint_to_state_dict(
    checkpoint_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    dtype: torch.dtype | str = torch.float32,
    max_shard_size: int | str | None = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
    *,
    progress: bool = False,
) -> Path:
    """Consolidate a ZeRO checkpoint and write it into `output_dir` in `dtype`, as Hugging Face lays weights out.

    `pytorch_model.bin` (`model.safetensors` with `safe_serialization`) when the weights fit in
    `max_shard_size` (`"5GB"`, `"500MiB"`, bytes, or None for one file); otherwise numbered shards and
    an `.index.json` (`ds_zero._checkpoint.hf_shards`). Floating-point tensors are cast to `dtype`
    (`float32/fp32/float16/fp16/bfloat16/bf16` or a torch.dtype); tied weights stay tied.

    Returns:
        `output_dir`.

    Raises:
        ValueError: `output_dir` is an existing file or looks like a file name (`.bin`, `.pt`, ...: the
            older signature took a file); a bad `dtype` or `max_shard_size`. Checked before any reading.
        FileNotFoundError: no such checkpoint (see `get_fp32_state_dict_from_zero_checkpoint`).
        ImportError: `safe_serialization` without the safetensors package.
    """
    out = _check_output_dir(output_dir)
    target = _torch_dtype(dtype)
    parse_shard_size(max_shard_size)
    state_dict = get_fp32_state_dict_from_zero_checkpoint(
        checkpoint_dir, tag, exclude_frozen_parameters, progress=progress
    )
    write_state_dict_dir(
        _cast(state_dict, target), out, max_shard_size=max_shard_size, safe_serialization=safe_serialization
    )
    return out


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    max_shard_size: int | str | None = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
    *,
    progress: bool = False,
) -> Path:
    """`convert_zero_checkpoint_to_state_dict` in fp32 (DeepSpeed's name and argument order); returns `output_dir`."""
    return convert_zero_checkpoint_to_state_dict(
        checkpoint_dir,
        output_dir,
        torch.float32,
        max_shard_size,
        safe_serialization,
        tag,
        exclude_frozen_parameters,
        progress=progress,
    )


def load_state_dict_from_zero_checkpoint(
    model: torch.nn.Module, checkpoint_dir: str | os.PathLike[str], tag: str | None = None
) -> torch.nn.Module:
    """Load the consolidated fp32 weights into `model` (non-strict, as DeepSpeed does) and return it."""
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model.load_state_dict(state_dict, strict=False)
    return model


def run_consolidation_cli(argv: Sequence[str] | None, *, prog: str, description: str, with_dtype: bool) -> int:
    """The command line `ds-zero-to-fp32` and `zero_to_torch` share (`with_dtype`: a required `--dtype`, as
    DeepSpeed's `zero_to_torch.py` takes; without it fp32). Returns the exit status."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("checkpoint_dir", help="save directory holding 'latest' (or a tag directory)")
    parser.add_argument("output_dir", help="directory for pytorch_model.bin (or shards and an index)")
    if with_dtype:
        parser.add_argument("--dtype", required=True, choices=sorted(_DTYPES), help="output tensor dtype")
    parser.add_argument("--max_shard_size", default="5GB", help="largest shard, e.g. 5GB or 500MiB (default 5GB)")
    parser.add_argument("--safe_serialization", action="store_true", help="write model.safetensors")
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag (default: read from 'latest')")
    parser.add_argument("--exclude_frozen_parameters", action="store_true", help="leave out frozen parameters")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    parser.add_argument("-d", "--debug", action="store_true", help="debug logging")
    args = parser.parse_args(argv)
    dtype = args.dtype if with_dtype else "fp32"
    if args.debug:
        logging.basicConfig(level=logging.DEBUG)
    try:
        out = convert_zero_checkpoint_to_state_dict(
            args.checkpoint_dir,
            args.output_dir,
            dtype=dtype,
            max_shard_size=args.max_shard_size,
            safe_serialization=args.safe_serialization,
            tag=args.tag,
            exclude_frozen_parameters=args.exclude_frozen_parameters,
            progress=not args.quiet,
        )
    except (FileNotFoundError, ValueError, ImportError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    if not args.quiet:
        print(f"saved {dtype} state_dict to {out}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`ds-zero-to-fp32 CHECKPOINT_DIR OUTPUT_DIR [...]`: returns the exit status."""
    return run_consolidation_cli(argv, prog="ds-zero-to-fp32", description=__doc__.split("\n\n")[0], with_dtype=False)


if __name__ == "__main__":
    sys.exit(main())
