"""DeepSpeed's data efficiency library, ds's code: curriculum schedules and random layerwise token dropping.

- `curriculum`: `CurriculumScheduler`, the difficulty schedule of one curriculum metric (used by the
  `data_efficiency.data_sampling.curriculum_learning` data sampler);
- `ltd_scheduler`: `RandomLTDScheduler`, the kept sequence length of the random-LTD layers per step;
- `token_ops`: the kept tokens' sampling, gather and scatter (plain PyTorch autograd functions);
- `token_drop`: `RandomLayerTokenDrop`, the layer wrapper; `ltd_helpers`: wrapping a model, wiring the
  wrappers, state-dict names; `ltd_loops`: DeepSpeed's per-sequence reference gather/scatter;
- `section`: the `data_efficiency` section as DeepSpeed's nested dict (what the engine's
  `data_efficiency_config()` returns); `keys`: the key names (DeepSpeed's constants).

This layer sits just above `config/` (it reads nothing else of ds-engine); the engine and the data
sampler build on it. DeepSpeed's paths (`deepspeed.runtime.data_pipeline...`, `deepspeed.ops.random_ltd`)
re-export it.
"""
