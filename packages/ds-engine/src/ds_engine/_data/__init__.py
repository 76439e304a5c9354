"""Data efficiency's data sampling: mechanism the engine's curriculum loader and dynamic batching use.

`indexed_dataset` (the `.bin`/`.idx` format), `index_utils`, `analyzer` + `analyzer_reduce` and
`distributed_analyzer` (metric indexes of a dataset), `curriculum_schedule` (difficulty per step), `sampler`
(`DeepSpeedDataSampler`), `loader` (the curriculum loader), `variable_batch` and `dynamic_batching`
(variable batch size and lr), `describe` (for `explain`).
This layer imports no other ds-engine layer: it takes plain arguments and DeepSpeed's config dicts, and
`config/` imports it to check curriculum metrics with the schedule's own rules.
"""
