"""Stage-3 partitioned parameters: the data structure, its gather collective, `GatheredParameters`.

The bottom layer of stage 3, usable without any optimizer or hooks: `partitioned_param` (a parameter that
keeps its shape while each rank holds 1/N of it; its state and status transitions), `shards` (shards
read and written wherever they live, memory or NVMe), `secondary` (hpZ's second slice), `gather`
(the coalesced, fingerprint-checked all-gather), `gathered_parameters` (the explicit gather block and
external-parameter registration), `param_methods` (DeepSpeed's `param.all_gather()` / `param.partition()`),
`partitioning` (turning a parameter into a partitioned one and binding those methods) and
`partitioned_module` (partitioning a model, conversions, state_dict). Each file imports only the ones
before it in that order (`active_consumers` and `param_dict` aside), so the state never reaches up.
"""
