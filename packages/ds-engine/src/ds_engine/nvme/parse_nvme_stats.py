"""`deepspeed.nvme.parse_nvme_stats`, DeepSpeed's module path: ds-ops' `ds_ops.nvme_stats` under it.

`python -m deepspeed.nvme.parse_nvme_stats --log_dir DIR --metric read_speed|write_speed` reports every
sweep log's speed. Both names are one module object (`_reexport.alias_module`).
"""

from typing import TYPE_CHECKING

from ds_engine._reexport import alias_module

if TYPE_CHECKING:
    from ds_ops.nvme_stats import *  # noqa: F403

alias_module(__name__, "ds_ops.nvme_stats")
