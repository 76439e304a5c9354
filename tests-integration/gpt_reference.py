"""Single-process plain-PyTorch reference for `examples/train_gpt.py` runs (no ds imports).

It replays what a data-parallel run computes, from first principles:
* data: the engine's loader is a `DistributedSampler` (shuffled, seed 0, epoch 0; a PipelineEngine's reads in
  order, as DeepSpeed's does: `shuffled=False`) per data-parallel rank with the micro batch as its batch size;
  rank r of W takes positions r, r+W, r+2W... of that order, so step s of a run trains on the contiguous block
  of that order after the samples consumed so far, and rank 0's micro batch is every W-th sample of the block;
* the update: the mean of the ranks' micro-batch losses (what averaging gradients over ranks gives),
  gradient clipping to the global norm, torch's AdamW, and DeepSpeed's WarmupLR formula (the lr is the
  minimum at construction and moves once per optimizer step).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
from data import VOCAB, CharDataset  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402


def warmup_lr(params: dict, optimizer_step: int) -> float:
    """The lr DeepSpeed's WarmupLR gives the `optimizer_step`-th (1-based) step."""
    lo, hi = float(params.get("warmup_min_lr", 0.0)), float(params["warmup_max_lr"])
    n = max(2, int(params.get("warmup_num_steps", 1000)))
    it = optimizer_step - 2  # construction sets the minimum; each applied step advances the iteration
    if it < 0:
        return lo
    if it >= n:
        return hi
    gamma = it / n if params.get("warmup_type", "log") == "linear" else math.log(it + 1) / math.log(n)
    return lo + (hi - lo) * gamma


@dataclass
class Reference:
    """The reference run's state: the model, its optimizer, and what it has recorded so far."""

    config: dict
    layers: int
    dim: int
    seed: int = 0
    shuffled: bool = True
    model: GPT = field(init=False)
    optimizer: torch.optim.AdamW = field(init=False)
    dataset: CharDataset = field(init=False)
    order: torch.Tensor = field(init=False)
    losses: list[float] = field(default_factory=list)
    """Rank 0's last micro-batch loss at each step (what train_gpt.py logs without a pipeline)."""
    mean_losses: list[float] = field(default_factory=list)
    """The mean over every rank's micro batches (what a PipelineEngine's train_batch returns)."""
    consumed: int = 0

    def __post_init__(self) -> None:
        torch.manual_seed(self.seed)
        cfg = GPTConfig(vocab_size=len(VOCAB), num_layers=self.layers, dim=self.dim)
        self.model = GPT(cfg)
        self.dataset = CharDataset(block_size=cfg.block_size)
        n = len(self.dataset)
        self.order = torch.randperm(n, generator=torch.Generator().manual_seed(0)) if self.shuffled else torch.arange(n)
        opt = self.config["optimizer"]["params"]
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=0.0,
            betas=tuple(opt.get("betas", (0.9, 0.999))),
            eps=opt.get("eps", 1e-8),
            weight_decay=opt.get("weight_decay", 0.01),
        )

    def _batch(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        items = [self.dataset[int(i)] for i in self.order[positions]]
        return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])

    def train(self, steps: int, world: int, accumulation: int = 1) -> None:
        """`steps` optimizer steps as a run on `world` data-parallel ranks takes them.

        With `accumulation` micro batches per step, rank r's j-th micro batch of a step is its loader's
        j-th batch there: positions j*micro..(j+1)*micro of the rank's share of the step's block.
        """
        micro = self.config["train_micro_batch_size_per_gpu"]
        clip = self.config.get("gradient_clipping", 0.0)
        per_step = micro * world * accumulation
        for _ in range(steps):
            block = torch.arange(self.consumed, self.consumed + per_step)
            for group in self.optimizer.param_groups:
                group["lr"] = warmup_lr(self.config["scheduler"]["params"], len(self.losses) + 1)
            self.optimizer.zero_grad()
            micro_losses = [
                [self.model(*self._batch(block[r::world][j * micro : (j + 1) * micro])) for j in range(accumulation)]
                for r in range(world)
            ]
            mean = torch.stack([loss for rank in micro_losses for loss in rank]).mean()
            mean.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
            self.optimizer.step()
            self.losses.append(micro_losses[0][-1].item())
            self.mean_losses.append(mean.item())
            self.consumed += per_step

    def eval_loss(self, model: GPT | None = None) -> float:
        """Loss on train_gpt.py's fixed held-out batch (the dataset's first 16 windows)."""
        model = model or self.model
        x, y = (torch.stack(t) for t in zip(*(self.dataset[i] for i in range(16)), strict=True))
        model.eval()
        with torch.no_grad():
            loss = model(x, y).item()
        model.train()
        return loss

    def new_model(self) -> GPT:
        """A fresh GPT of the same shape (to load a consolidated state_dict into)."""
        return GPT(self.model.cfg)
