"""Making a checkpoint's recovery script executable, where the file system allows it.

ds-zero copies `zero_to_fp32.py` into every ZeRO checkpoint and marks it executable itself (logging on
its own logger when it cannot). DeepSpeed's engine exposes the chmod step as the private
`_change_recovery_script_permissions(dst)`, and scripts and tests call it directly and watch
DeepSpeed's "DeepSpeed" logger for the outcome; this is that step, reporting there.
"""

from __future__ import annotations

import os
import stat

from ds_engine._report.logging import logger as deepspeed_logger

__all__ = ["change_recovery_script_permissions"]


def change_recovery_script_permissions(dst: str | os.PathLike[str]) -> bool:
    """Add the owner's execute bit to `dst`; returns whether it could.

    Some file shares (Azure Files, FUSE and NFS mounts) refuse chmod, and a missing file cannot be
    changed: neither is worth failing a save over, since `python zero_to_fp32.py` runs the script
    without the bit. The failure is logged at INFO on the "DeepSpeed" logger, naming the file and the
    error, and the save goes on.
    """
    try:
        os.chmod(dst, os.stat(dst).st_mode | stat.S_IEXEC)
    except OSError as err:
        deepspeed_logger.info(
            "could not make %s executable (%s); continuing without changing its permissions (run it as `python %s`)",
            dst,
            err,
            os.path.basename(dst),
        )
        return False
    return True
