"""Building partitioned models: ZeRO stage 3's construction-time side, below the run-time `_schedule`.

`init` (`ds_zero.Init`, partitioning modules as they are constructed) on `init_base` (DeepSpeed's base class,
the part that outlives the context), `launcher_world` (the stray one-rank group check), `linear` (the stage-3
linear and its process-wide install), `torch_patches` (undoing what stage 3 installs into torch),
`quantized_init` (ZeRO-Inference's quantized weights) and `tiling` (`TiledLinear`, a linear built as tiles).
"""
