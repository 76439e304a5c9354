"""`deepspeed.nvme.test_ds_aio`: `ds_io`'s entry point (ds-ops' `ds_ops.nvme_bench`).

python -m deepspeed.nvme.test_ds_aio --folder DIR --io_size 64M
"""

from __future__ import annotations

import sys

from ds_ops.nvme_bench import ds_io_main

__all__ = ["ds_io_main"]

if __name__ == "__main__":
    sys.exit(ds_io_main())
