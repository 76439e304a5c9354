"""A CIFAR-10 of seeded synthetic images: same shapes, dtypes and item layout, no download.

Each class has a fixed random pattern and an image is its class's pattern plus noise, so a small
network can learn it and the loss falls the way it does on the real set. The set is the same on
every host and every run (a fixed generator seed per split), which is what lets two stacks be
compared loss for loss.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

#: Samples per split; small so a program's epoch is a few dozen steps on a CPU.
TRAIN_SIZE = int(os.environ.get("DS_EXAMPLES_CIFAR_TRAIN", "512"))
TEST_SIZE = int(os.environ.get("DS_EXAMPLES_CIFAR_TEST", "64"))


class CIFAR10(torch.utils.data.Dataset):
    """`torchvision.datasets.CIFAR10`'s signature; items are (transform(image), label) with a uint8 HWC image."""

    classes = ("plane", "car", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")

    def __init__(
        self,
        root: str,
        train: bool = True,
        transform: Callable[[torch.Tensor], Any] | None = None,
        target_transform: Callable[[int], Any] | None = None,
        download: bool = False,
    ) -> None:
        self.root, self.train = root, train
        self.transform, self.target_transform = transform, target_transform
        patterns = torch.randn(10, 32, 32, 3, generator=torch.Generator().manual_seed(1234))
        generator = torch.Generator().manual_seed(0 if train else 1)
        size = TRAIN_SIZE if train else TEST_SIZE
        self.targets = torch.randint(0, 10, (size,), generator=generator).tolist()
        noise = torch.randn(size, 32, 32, 3, generator=generator)
        images = 128 + 50 * patterns[torch.tensor(self.targets)] + 40 * noise
        self.data = images.clamp(0, 255).to(torch.uint8)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        image: Any = self.data[index]
        target: Any = self.targets[index]
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target
