"""Per-parameter access to ZeRO's partitioned state: DeepSpeed's `safe_get_full_fp32_param` family, ds-zero's side.

`owner` maps a parameter to the ZeRO optimizer holding its fp32 master, gradient and optimizer state
(`zero_optimizer_of`); `stage12` and `stage3` are the optimizers' methods that read and write those for
one parameter, whole (a collective over the data-parallel group) or this rank's partition.

[Note: a new fp32 master reaches the model's weights at once]
DeepSpeed's setters write only the fp32 master; the model's 16-bit weights take it at the next step.
In ds an fp32 model's master *is* the model's own partition (no second copy, `_stage12.partitions`), so
a master-only write would change one rank's part of a stage-1/2 weight and not the others', and the
ranks would compute with different weights until the step. So setting a master value also writes the
model's weights (the whole value at stages 1/2, which every rank passes; the shard at stage 3), the same
on every rank and for every dtype. After the next step both behaviours agree; in between, ds computes
with the new value. Optimizer-state setters touch only the state.
"""
