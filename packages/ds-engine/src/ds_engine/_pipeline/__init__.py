"""Pipeline parallelism in the engine: a `ds_pipe.PipelineModule` trained by a `PipelineEngine`.

`build` (the seam `initialize()` calls: recognise the module, check the call, build the engine), `engine`
(`PipelineEngine`: `train_batch`/`eval_batch` over the ds-pipe schedule), `clip` (gradient clipping over
every stage), `checkpoint` (the engine's per-stage checkpoint files).
"""
