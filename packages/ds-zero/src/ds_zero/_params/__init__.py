"""Stage-3 partitioned parameters: the data structure, its gather collective, `GatheredParameters`.

The bottom layer of stage 3, usable without any optimizer or hooks: `partitioned_param` (a parameter that
keeps its shape while each rank holds 1/N of it; its state), `partitioned_module` (partitioning a model,
conversions, state_dict), `gather` (the coalesced, fingerprint-checked all-gather), and
`gathered_parameters` (the explicit gather block and external-parameter registration).
"""
