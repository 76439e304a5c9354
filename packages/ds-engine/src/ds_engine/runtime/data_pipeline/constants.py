"""`deepspeed.runtime.data_pipeline.constants`: the `data_efficiency` key names (ds's `_data.keys`)."""

from __future__ import annotations

from ds_engine._data.keys import *  # noqa: F403  (DeepSpeed's scripts star-import these names)
from ds_engine._data.keys import __all__ as __all__
