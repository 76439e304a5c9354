"""`deepspeed.runtime.data_pipeline.constants`: the `data_efficiency` key names (ds's `_data_efficiency.keys`)."""

from __future__ import annotations

from ds_engine._data_efficiency.keys import *  # noqa: F403  (DeepSpeed's scripts star-import these names)
from ds_engine._data_efficiency.keys import __all__ as __all__
