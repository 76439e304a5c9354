"""`deepspeed.runtime.zenflow`: ZenFlow's config model (`zenflow_config`) and core split (`zenflow_utils`).

ds parses the `zero_optimization.zenflow` section (ds-zero's `ZenFlowConfig`) but runs no ZenFlow
training loop: `initialize()` refuses a config that enables it. The selective optimizers are
ds-ops' (`deepspeed.ops.adam.ZenFlowSelectiveAdamW[_stage3]`) and work on their own.
"""

from __future__ import annotations
