"""`deepspeed.checkpoint.autoep_universal`: AutoEP expert states in universal checkpoints (DeepSpeed's names).

The code is ds-engine's `ds_engine._checkpoint.offline.autoep_zero12`; `_zero12_fragment_path` and
`_autoep_zero12_dp_ranks` are DeepSpeed's private names for its `zero12_fragment_path` and
`autoep_zero12_dp_ranks`. The AutoEP+AutoTP folding record of each file is `_checkpoint.offline.autoep_folding`'s.
"""

from __future__ import annotations

from ds_engine._checkpoint.offline.autoep_experts import consolidate_autoep_expert_files, resolve_expert_ckpt_path
from ds_engine._checkpoint.offline.autoep_folding import make_folding_metadata, validate_folding_metadata
from ds_engine._checkpoint.offline.autoep_zero12 import (
    autoep_zero12_dp_ranks as _autoep_zero12_dp_ranks,
)
from ds_engine._checkpoint.offline.autoep_zero12 import (
    consolidate_autoep_zero12_expert_states,
)
from ds_engine._checkpoint.offline.autoep_zero12 import (
    zero12_fragment_path as _zero12_fragment_path,
)

__all__ = [
    "_autoep_zero12_dp_ranks",
    "_zero12_fragment_path",
    "consolidate_autoep_expert_files",
    "consolidate_autoep_zero12_expert_states",
    "make_folding_metadata",
    "resolve_expert_ckpt_path",
    "validate_folding_metadata",
]
