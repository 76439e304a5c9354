"""A tiny deterministic corpus and a next-token dataset over it (no downloads, same bytes everywhere)."""

from __future__ import annotations

import random

import torch
from torch.utils.data import Dataset

_SUBJECTS = ["the cat", "a dog", "my friend", "the old man", "a small bird", "the teacher", "our neighbour"]
_VERBS = ["sees", "likes", "follows", "finds", "draws", "hears", "keeps"]
_OBJECTS = ["the red ball", "a green tree", "the river", "a quiet song", "the big house", "an open door"]
_ENDINGS = [" today.", " again.", " at night.", " in the park.", " every morning.", "."]

VOCAB = sorted(set("abcdefghijklmnopqrstuvwxyz .,\n"))
STOI = {c: i for i, c in enumerate(VOCAB)}


def make_corpus(num_sentences: int = 4000, seed: int = 1234) -> str:
    """Sentences from a small grammar: enough structure that a small model's loss visibly falls."""
    rng = random.Random(seed)
    lines = []
    for _ in range(num_sentences):
        lines.append(f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}{rng.choice(_ENDINGS)}")
    return "\n".join(lines) + "\n"


def encode(text: str) -> torch.Tensor:
    return torch.tensor([STOI[c] for c in text], dtype=torch.long)


def decode(ids: torch.Tensor) -> str:
    return "".join(VOCAB[i] for i in ids.tolist())


class CharDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Windows of `block_size` characters; item i is (x, y) with y = x shifted by one."""

    def __init__(self, block_size: int = 64, num_sentences: int = 4000, seed: int = 1234) -> None:
        self.data = encode(make_corpus(num_sentences, seed))
        self.block_size = block_size

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.block_size
        chunk = self.data[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]
