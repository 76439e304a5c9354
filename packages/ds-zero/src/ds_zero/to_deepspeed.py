"""Write a ds checkpoint (any ZeRO stage, any world size) as one DeepSpeed 0.19.8 loads.

Command line::

    python -m ds_zero.to_deepspeed CHECKPOINT_DIR OUTPUT_DIR [-t TAG] [--world_size N] [--stage S]

`CHECKPOINT_DIR` is ds's save directory (holding `latest`); `OUTPUT_DIR` receives DeepSpeed's tree:
`latest`, `<tag>/mp_rank_00_model_states.pt` (stage 3: `zero_pp_rank_{r}_mp_rank_00_model_states.pt`
for every rank, the partitioned parameters as empty tensors, as DeepSpeed writes them) and
`<tag>/[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt` in DeepSpeed's per-rank layout, with
`ds_version`, `param_shapes`, `frozen_param_shapes` and DeepSpeed's class paths for the loss scaler,
`ZeroStageEnum` and `fragment_address`, plus ds's torch-only `zero_to_fp32.py`. DeepSpeed loads
ZeRO files only at the world size they were written for: `--world_size` picks it (default: the
world size of the ds save), `--stage` the ZeRO stage (default: the saved one).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import ds_comm
from ds_comm.checkpoint_files import deepspeed_pickle_names, load_checkpoint_file
from ds_zero._checkpoint.deepspeed_export import DEEPSPEED_VERSION, deepspeed_rank_state_dict
from ds_zero._checkpoint.format import FragmentIndex
from ds_zero._checkpoint.io import read_latest_tag
from ds_zero._checkpoint.partition_files import deepspeed_model_states_file, load_partition_state_dicts
from ds_zero._checkpoint.script_copy import copy_zero_to_fp32_script

__all__ = ["convert_to_deepspeed", "main"]


def _module_dtype(module: dict[str, Any], names: Sequence[str]) -> torch.dtype:
    for name in names:
        value = module.get(name)
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.dtype
    return torch.float32


def _param_shapes(states: dict[str, Any], index: FragmentIndex) -> list[OrderedDict[str, torch.Size]]:
    saved = states.get("param_shapes")
    if saved and all(saved):  # ds before this release wrote [{}] under ZeRO: then the partitions say
        return [OrderedDict((n, torch.Size(s)) for n, s in group.items()) for group in saved]
    groups: dict[int, OrderedDict[str, torch.Size]] = {}
    for sd in index.state_dicts[:1]:
        for meta in sd["partitions"]:
            for name, shape in meta["param_shapes"].items():
                groups.setdefault(int(meta["group_index"]), OrderedDict())[name] = torch.Size(shape)
    return [groups[g] for g in sorted(groups)]


def convert_to_deepspeed(
    checkpoint_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    *,
    tag: str | None = None,
    world_size: int | None = None,
    stage: int | None = None,
) -> Path:
    """Write DeepSpeed's layout of the ds checkpoint `checkpoint_dir` (tag `tag`, default `latest`) to `output_dir`.

    Returns:
        The written tag directory.

    Raises:
        FileNotFoundError: no checkpoint there. ValueError: not a ZeRO checkpoint, or a bad world size/stage.
    """
    root = Path(checkpoint_dir)
    tag = str(tag) if tag is not None else read_latest_tag(root)
    src = root / tag
    parts = load_partition_state_dicts(src)
    index = FragmentIndex(parts)
    states_file = deepspeed_model_states_file(src)
    if states_file is None:
        raise FileNotFoundError(f"{src} has no mp_rank_00_model_states.pt")
    states = load_checkpoint_file(states_file)
    world = int(world_size or parts[0]["partition_count"])
    stage = int(stage or parts[0]["zero_stage"])
    if world < 1 or stage not in (1, 2, 3):
        raise ValueError(f"world_size must be >= 1 and stage 1, 2 or 3; got {world} and {stage}")
    shapes = _param_shapes(states, index)
    names = [n for group in shapes for n in group]
    module = dict(states.get("module") or {})
    dtype = _module_dtype(module, names)
    prefix = "bf16_" if dtype == torch.bfloat16 else ""
    out = Path(output_dir) / tag
    out.mkdir(parents=True, exist_ok=True)
    model_states = {
        **states,
        "param_shapes": shapes,
        "frozen_param_shapes": {} if stage >= 2 else None,
        "shared_params": dict(states.get("shared_params") or {}),
        "frozen_param_fragments": {} if stage >= 2 else None,
        "dp_world_size": world,
        "ds_version": DEEPSPEED_VERSION,
    }
    ds_config = states.get("ds_config") or {}
    with deepspeed_pickle_names():
        if stage == 3:
            placeholders = {n: torch.empty(0, dtype=module[n].dtype if n in module else dtype) for n in names}
            stage3_states = {
                **model_states,
                "module": OrderedDict((k, placeholders.get(k, v)) for k, v in module.items()),
            }
            for rank in range(world):
                ds_comm.atomic_save(stage3_states, out / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
        else:
            ds_comm.atomic_save(model_states, out / "mp_rank_00_model_states.pt")
        for rank in range(world):
            sd = deepspeed_rank_state_dict(index, shapes, world=world, rank=rank, stage=stage)
            ds_comm.atomic_save(
                {"optimizer_state_dict": sd, "ds_config": ds_config, "ds_version": DEEPSPEED_VERSION},
                out / f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
            )
    ds_comm.atomic_write_text(Path(output_dir) / "latest", tag)
    copy_zero_to_fp32_script(output_dir)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m ds_zero.to_deepspeed CHECKPOINT_DIR OUTPUT_DIR`: returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m ds_zero.to_deepspeed", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint_dir", help="ds's save directory (holding 'latest')")
    parser.add_argument("output_dir", help="where DeepSpeed's layout is written")
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag (default: read from 'latest')")
    parser.add_argument("--world_size", type=int, default=None, help="DeepSpeed's data-parallel world size")
    parser.add_argument("--stage", type=int, default=None, choices=(1, 2, 3), help="DeepSpeed's ZeRO stage")
    args = parser.parse_args(argv)
    try:
        out = convert_to_deepspeed(
            args.checkpoint_dir, args.output_dir, tag=args.tag, world_size=args.world_size, stage=args.stage
        )
    except (FileNotFoundError, ValueError) as err:
        print(f"to_deepspeed: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote DeepSpeed checkpoint {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
