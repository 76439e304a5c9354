"""NVMe offload (ZeRO-Infinity) through ds-ops' async I/O: swap files and pinned buffers.

`files` (swap files, their size and checksum checks), `buffers` (pools of pinned buffers), `param_swapper`
(stage-3 parameter shards) and `grad_swapper`. The optimizer-state swapper is the stage-3 optimizer's
(`_stage3.optimizer_swapper`: it swaps that optimizer's tiles), so this package never imports `_stage3`.
"""
