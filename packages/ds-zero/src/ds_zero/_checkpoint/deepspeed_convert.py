"""A ds checkpoint written in DeepSpeed 0.19.8's layout: the conversion behind `python -m ds_zero.to_deepspeed`.

Also the first step of the universal converter for a ds save (`universal_write`), so it sits with the other
checkpoint files; `ds_zero.to_deepspeed` is its command line and public name.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import ds_comm
from ds_zero._checkpoint.deepspeed_files import write_deepspeed_files
from ds_zero._checkpoint.io import read_latest_tag
from ds_zero._checkpoint.script_copy import copy_recovery_scripts

__all__ = ["convert_to_deepspeed"]

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
