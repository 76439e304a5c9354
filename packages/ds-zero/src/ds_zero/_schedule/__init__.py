"""ZeRO stage 3 at run time: when each partitioned parameter of a running model is gathered and released.

`coordinator` (module stack, iterations, on-demand gathers) with `live` (the gathered parameters and
`max_live_parameters`), `prefetch` (along `trace`, the recorded execution order), `saved_tensors` (the
autograd safety net), `returned_params` (parameters a forward hands back), `units` (what each module
gathers), `leaf_modules` and `granularity` (modules gathered whole) and `hooks` (the module and autograd
hooks); `module` wraps it all as `DeepSpeedZeRoOffload`, and `generation` gathers a managed model whole for
`unwrap_model_for_generation`. The optimizer (`_stage3`) builds on it; building a partitioned model
(`_construct`) sits below it.
"""
