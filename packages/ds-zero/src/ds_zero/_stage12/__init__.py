"""ZeRO stages 1 and 2: `optimizer` (`DeepSpeedZeroOptimizer`) and the pieces it is built from.

`flat_buffer` (a param group flattened into one padded buffer, the parameters views of it), `partitions`
(this rank's fp32 master and gradient partitions), `reduce` (a flat range reduced to the ranks owning it)
and `buckets` (stage 2: reduced during backward, bucket by bucket), `allgather` (updated partitions back
to every rank), `state` (the optimizer's partitions in the shared checkpoint format), `param_access` (one
parameter's fp32 master, gradient and optimizer state, whole or as this rank's fragment).
"""
