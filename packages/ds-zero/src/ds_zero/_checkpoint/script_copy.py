"""Put ds's torch-only `zero_to_fp32.py` next to a checkpoint, as DeepSpeed puts its own there."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import ds_comm

logger = logging.getLogger(__name__)

__all__ = ["ZERO_TO_FP32_SCRIPT", "copy_zero_to_fp32_script"]

#: The standalone script (only torch imports): ds-zero's `_checkpoint/standalone_zero_to_fp32.py`.
ZERO_TO_FP32_SCRIPT = Path(__file__).with_name("standalone_zero_to_fp32.py")


def copy_zero_to_fp32_script(save_dir: str | os.PathLike[str]) -> Path:
    """Write `save_dir/zero_to_fp32.py` (atomically, executable); `python zero_to_fp32.py . out.bin` then works
    in `save_dir` with only torch installed. An identical copy already there is kept. Returns its path.

    A file system that refuses chmod (Azure Files, some FUSE/NFS mounts) leaves the script readable but not
    executable, which costs `python zero_to_fp32.py` nothing: it is logged, and the save goes on."""
    target = Path(save_dir) / "zero_to_fp32.py"
    text = ZERO_TO_FP32_SCRIPT.read_text()
    if not (target.is_file() and target.read_text() == text):  # every save calls this: rewrite only on change
        ds_comm.atomic_write_text(target, text)
    try:
        target.chmod(target.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    except OSError as err:
        logger.info("could not make %s executable (%s); run it with `python zero_to_fp32.py`", target, err)
    return target
