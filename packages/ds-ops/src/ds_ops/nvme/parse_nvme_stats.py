"""`deepspeed.nvme.parse_nvme_stats`: read the speed of every sweep log (ds-ops' `ds_ops.nvme_stats`).

python -m deepspeed.nvme.parse_nvme_stats --log_dir DIR --metric read_speed|write_speed
"""

from __future__ import annotations

import sys

from ds_ops.nvme_stats import *  # noqa: F403
from ds_ops.nvme_stats import __all__ as _names
from ds_ops.nvme_stats import parse_nvme_stats_main

main = parse_nvme_stats_main
"""DeepSpeed's name of the command's entry point."""

__all__ = [*_names, "main"]

if __name__ == "__main__":
    sys.exit(parse_nvme_stats_main())
