"""The example GPT as a 2-stage pipeline with ds-pipe alone (no engine): `pip install ds-pipe`, then

    python -m ds_launcher --num_gpus 2 examples/pipe_alone.py      # or: torchrun --nproc_per_node 2 ...

Each rank builds only its stage's layers; the executor runs DeepSpeed's 1F1B schedule and a plain
torch optimizer steps this stage's parameters.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import ds_comm
from ds_pipe import LayerSpec, PipelineExecutor, PipelineModule

sys.path.insert(0, str(Path(__file__).parent))
from data import VOCAB, CharDataset  # noqa: E402
from gpt import Block, Embedding, GPTConfig, Head, lm_loss  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--micro_batches", type=int, default=4)
    parser.add_argument("--micro_batch_size", type=int, default=8)
    args = parser.parse_args()
    ds_comm.init_distributed()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=len(VOCAB), num_layers=4, dim=64, tie_embeddings=False)
    layers = [
        LayerSpec(Embedding, cfg),
        *(LayerSpec(Block, cfg) for _ in range(cfg.num_layers)),
        LayerSpec(Head, cfg, None),
    ]
    model = PipelineModule(layers, num_stages=ds_comm.get_world_size(), loss_fn=lm_loss, partition_method="parameters")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    pipe = PipelineExecutor(model, micro_batches=args.micro_batches, optimizer_step=optimizer.step)
    loader = torch.utils.data.DataLoader(
        CharDataset(block_size=cfg.block_size),
        batch_size=args.micro_batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(0),
        drop_last=True,
    )
    batches = iter(loader)
    for step in range(1, args.steps + 1):
        optimizer.zero_grad(set_to_none=True)
        loss = pipe.train_batch(batches)
        if ds_comm.get_rank() == 0 and (step == 1 or step % 5 == 0):
            print(f"step {step:3d} | loss {loss.item():.4f}", flush=True)
    ds_comm.destroy_process_group()


if __name__ == "__main__":
    main()
