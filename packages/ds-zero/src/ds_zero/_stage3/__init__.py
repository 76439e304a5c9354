"""ZeRO stage 3 on top of `_params`: scheduling the gathers of a running model, and the optimizer.

Scheduling: `coordinator` (module stack, iterations, on-demand gathers) with `live` (the gathered
parameters and `max_live_parameters`), `prefetch` (along `trace`, the recorded execution order),
`saved_tensors` (the autograd safety net), `units` (what each module gathers) and `hooks` (the module and
autograd hooks); `module` wraps it all as `DeepSpeedZeRoOffload`, `init` is `ds_zero.Init`. The optimizer:
`optimizer` (`DeepSpeedZeroOptimizer_Stage3`), `partition` (the fp32 shard tiles), `grads` (gradient
reduce-scatter) and `checkpoint` (its state in the shared format).
"""
