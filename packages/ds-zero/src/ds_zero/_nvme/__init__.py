"""NVMe offload (ZeRO-Infinity) through ds-ops' async I/O: swap files and pinned buffers.

`files` (swap files, their size and checksum checks), `buffers` (pools of pinned buffers), and the two
users: `param_swapper` (stage-3 parameter shards) and `optimizer_swapper` (fp32 master and optimizer
state per tile).
"""
