"""Stage-3 modes for benchmarks/zero.py: torch FSDP2 (`fully_shard` per block + root) and ds_zero stage 3.

Both shard the same already built model over the 2 ranks and run AdamW (foreach) on the shards. FSDP2
gathers each block in one collective and reshards after forward; stage 3 is configured to match: a
prefetch bucket of one block, a live budget of two blocks plus the tied embedding, reduce-scatter
buckets of one block (FSDP2 reduce-scatters each block's gradients), the optimizer step tiled by one
block (`sub_group_size`; FSDP2 steps per-parameter tensors), and parameters under 100k elements
(LayerNorms, biases) kept whole.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

import ds_zero

ADAMW = dict(lr=3e-4, weight_decay=0.01, foreach=True)


def block_numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.blocks[0].parameters())


def setup_fsdp2(model: nn.Module) -> tuple[nn.Module, Callable[[torch.Tensor], None], str]:
    from torch.distributed.fsdp import fully_shard

    for blk in model.blocks:
        fully_shard(blk)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    return model, (lambda loss: (loss.backward(), opt.step(), opt.zero_grad())), "fully_shard per block + root"


def setup_stage3(model: nn.Module) -> tuple[nn.Module, Callable[[torch.Tensor], None], str]:
    block = block_numel(model)
    embed = model.wte.weight.numel()
    config = ds_zero.ZeroConfig(
        stage=3,
        reduce_bucket_size=block,
        sub_group_size=block,
        stage3_prefetch_bucket_size=block,
        stage3_max_live_parameters=2 * block + embed,
        stage3_max_reuse_distance=block,
        stage3_param_persistence_threshold=100_000,
    )
    opt = ds_zero.DeepSpeedZeroOptimizer_Stage3(model, torch.optim.AdamW(model.parameters(), **ADAMW), config=config)
    note = (
        f"prefetch, reduce and step buckets {block / 1e6:.2f}M, max_live {(2 * block + embed) / 1e6:.2f}M, "
        f"reuse {block / 1e6:.2f}M elements"
    )
    return model, (lambda loss: (opt.backward(loss), opt.step(), opt.zero_grad())), note
