"""Write a ds checkpoint (any ZeRO stage, any world size) as one DeepSpeed 0.19.8 loads.

Command line::

    python -m ds_zero.to_deepspeed CHECKPOINT_DIR OUTPUT_DIR [-t TAG] [--world_size N] [--stage S]

`CHECKPOINT_DIR` is ds's save directory (holding `latest`); `OUTPUT_DIR` receives DeepSpeed's tree:
`latest`, `<tag>/mp_rank_00_model_states.pt` (stage 3: `zero_pp_rank_{r}_mp_rank_00_model_states.pt`
for every rank, the partitioned parameters as empty tensors, as DeepSpeed writes them) and
`<tag>/[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt` in DeepSpeed's per-rank layout, with
`ds_version`, `param_shapes`, `frozen_param_shapes` and DeepSpeed's class paths for the loss scaler,
`ZeroStageEnum` and `fragment_address`, plus ds's torch-only `zero_to_fp32.py` and `zero_to_torch.py`. DeepSpeed loads
ZeRO files only at the world size they were written for: `--world_size` picks it (default: the
world size of the ds save), `--stage` the ZeRO stage (default: the saved one).

Every model-parallel rank of the save is written: a pipeline checkpoint's stages (`mp_rank_{stage:02d}`
files, each stage's optimizer partitions over its own data-parallel ranks, `--world_size` being the
data-parallel degree) with its `layer_XX-model_states.pt` weight files copied as they are (ds writes
DeepSpeed's layer files). DeepSpeed's pipeline engine takes ZeRO stage 0 or 1 only.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import ds_comm
from ds_zero._checkpoint.deepspeed_files import write_deepspeed_files
from ds_zero._checkpoint.io import read_latest_tag
from ds_zero._checkpoint.script_copy import copy_recovery_scripts

__all__ = ["convert_to_deepspeed", "main"]

_MP_RANK = re.compile(r"zero_pp_rank_\d+_mp_rank_(\d+)_?optim_states\.pt$")
_LAYER_FILE = re.compile(r"layer_\d+-model_states\.pt")


def _mp_ranks(src: Path) -> list[int]:
    """The model-parallel ranks (pipeline stages) with optimizer files in `src`, checked to be 0..n-1."""
    ranks = sorted({int(m.group(1)) for p in src.glob("*optim_states.pt") if (m := _MP_RANK.search(p.name))})
    if ranks != list(range(len(ranks))):
        raise ValueError(f"{src}: optimizer files cover model-parallel ranks {ranks}; some are missing")
    return ranks or [0]


def convert_to_deepspeed(
    checkpoint_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    *,
    tag: str | None = None,
    world_size: int | None = None,
    stage: int | None = None,
) -> Path:
    """Write DeepSpeed's layout of the ds checkpoint `checkpoint_dir` (tag `tag`, default `latest`) to `output_dir`.

    Every model-parallel rank (pipeline stage) of the save is written, and a pipeline's layer files copied.

    Returns:
        The written tag directory.

    Raises:
        FileNotFoundError: no checkpoint there. ValueError: not a ZeRO checkpoint, a bad world size/stage,
            or a pipeline checkpoint asked for ZeRO stage 2 or 3.
    """
    root = Path(checkpoint_dir)
    tag = str(tag) if tag is not None else read_latest_tag(root)
    src = root / tag
    layer_files = sorted(p for p in src.iterdir() if _LAYER_FILE.fullmatch(p.name)) if src.is_dir() else []
    out = Path(output_dir) / tag
    for mp_rank in _mp_ranks(src) if src.is_dir() else [0]:
        write_deepspeed_files(src, out, mp_rank=mp_rank, world_size=world_size, stage=stage, pipeline=bool(layer_files))
    for path in layer_files:
        shutil.copy2(path, out / path.name)
    ds_comm.atomic_write_text(Path(output_dir) / "latest", tag)
    copy_recovery_scripts(output_dir)
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
