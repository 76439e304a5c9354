"""Put ds's torch-only `zero_to_fp32.py` and `zero_to_torch.py` next to a checkpoint, as DeepSpeed does."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import ds_comm

logger = logging.getLogger(__name__)

__all__ = [
    "RECOVERY_SCRIPTS",
    "ZERO_TO_FP32_SCRIPT",
    "ZERO_TO_TORCH_SCRIPT",
    "copy_recovery_scripts",
    "copy_zero_to_fp32_script",
]

#: The standalone scripts (only torch imports): ds-zero's `_checkpoint/standalone_*.py`.
ZERO_TO_FP32_SCRIPT = Path(__file__).with_name("standalone_zero_to_fp32.py")
ZERO_TO_TORCH_SCRIPT = Path(__file__).with_name("standalone_zero_to_torch.py")
#: The name each script gets in a save directory (DeepSpeed 0.19.8 copies both into every ZeRO save).
RECOVERY_SCRIPTS = {"zero_to_fp32.py": ZERO_TO_FP32_SCRIPT, "zero_to_torch.py": ZERO_TO_TORCH_SCRIPT}


def _copy(source: Path, target: Path) -> Path:
    text = source.read_text()
    if not (target.is_file() and target.read_text() == text):  # every save calls this: rewrite only on change
        ds_comm.atomic_write_text(target, text)
    try:
        target.chmod(target.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    except OSError as err:
        logger.info("could not make %s executable (%s); run it with `python %s`", target, err, target.name)
    return target


def copy_zero_to_fp32_script(save_dir: str | os.PathLike[str]) -> Path:
    """Write `save_dir/zero_to_fp32.py` (atomically, executable); `python zero_to_fp32.py . OUT_DIR` then works
    in `save_dir` with only torch installed. An identical copy already there is kept. Returns its path.

    A file system that refuses chmod (Azure Files, some FUSE/NFS mounts) leaves the script readable but not
    executable, which costs `python zero_to_fp32.py` nothing: it is logged, and the save goes on."""
    return _copy(ZERO_TO_FP32_SCRIPT, Path(save_dir) / "zero_to_fp32.py")


def copy_recovery_scripts(save_dir: str | os.PathLike[str]) -> list[Path]:
    """Write `save_dir/zero_to_fp32.py` and `save_dir/zero_to_torch.py` (which reads through the former and
    writes fp16/bf16 too), as `copy_zero_to_fp32_script` writes one. Returns their paths."""
    return [_copy(source, Path(save_dir) / name) for name, source in RECOVERY_SCRIPTS.items()]
