"""The ZeRO stage-3 optimizer, on top of `_params` (partitioned parameters) and `_schedule` (their gathers).

`optimizer` (`DeepSpeedZeroOptimizer_Stage3`), `partition` (the fp32 shard tiles), `partition_index` (the
optimizer's per-parameter record: master slice, gradient bucket and gradient slot), `grads` (gradient
reduce-scatter into the owners' partitions), `grad_views` (DeepSpeed's views of those gradient
partitions), `model_parallel` (which partition elements belong to tensor-parallel cut parameters, for the
norm), `optimizer_swapper` (the fp32 master and optimizer state of each tile on NVMe, over `_nvme`'s
files and buffers), `checkpoint` (its state in the shared format, and the consolidated 16-bit state_dict) and
`param_access` (one parameter's fp32 master, gradient and optimizer state).
"""
