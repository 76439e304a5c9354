"""DeepSpeed's data efficiency library, ds's code: data sampling, curriculum schedules and random-LTD.

Data sampling: `indexed_dataset` (the `.bin`/`.idx` format), `index_utils`, `analyzer` + `analyzer_reduce`
and `distributed_analyzer` (metric indexes of a dataset), `curriculum_schedule` (the config checks of a
curriculum metric), `sampler` (`DeepSpeedDataSampler`), `loader` (the curriculum loader), `variable_batch`
and `dynamic_batching` (variable batch size and lr), `repeating_loader` (`RepeatingLoader`), `describe`
(for `explain`).

Curriculum and data routing: `curriculum` (`CurriculumScheduler`, the difficulty schedule of one metric,
which the sampler steps); `ltd_scheduler` (`RandomLTDScheduler`, the kept sequence length of the random-LTD
layers per step); `root_schedule` (the growth curve both share); `token_ops` (the kept tokens' sampling,
gather and scatter as plain PyTorch autograd functions); `token_drop` (`RandomLayerTokenDrop`, the layer
wrapper); `ltd_helpers` (wrapping a model, wiring the wrappers, state-dict names); `ltd_loops` (the
per-sequence reference gather/scatter); `section` (the `data_efficiency` section as DeepSpeed's nested dict,
what the engine's `data_efficiency_config()` returns); `keys` (DeepSpeed's constants); `describe_routing`.

This layer imports no other ds-engine layer at run time: it takes plain arguments and DeepSpeed's config
dicts, and `config/` imports it to check curriculum metrics with the schedule's own rules. DeepSpeed's paths
(`deepspeed.runtime.data_pipeline...`, `deepspeed.ops.random_ltd`) re-export it.
"""
