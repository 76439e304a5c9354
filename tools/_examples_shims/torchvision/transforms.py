"""The transforms the programs compose, on the images the synthetic datasets yield.

A dataset item is a uint8 HWC tensor, standing for the PIL image torchvision would give: `Resize` and
`CenterCrop` take it (and keep it an image) before `ToTensor`, or a float CHW tensor after it, as torchvision's do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F


class Compose:
    def __init__(self, transforms: Sequence[Callable[[Any], Any]]) -> None:
        self.transforms = list(transforms)

    def __call__(self, image: Any) -> Any:
        for transform in self.transforms:
            image = transform(image)
        return image


class ToTensor:
    """uint8 HWC in [0, 255] -> float CHW in [0, 1], as torchvision's does for a PIL image."""

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return image.permute(2, 0, 1).to(torch.float32).div(255)


class Normalize:
    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return (image - self.mean) / self.std


class Resize:
    """The shorter side to `size` (an int), or to (height, width), bilinear, on a CHW tensor."""

    def __init__(self, size: int | Sequence[int]) -> None:
        self.size = size

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        if image.dtype == torch.uint8:
            return _on_image(self, image)
        height, width = image.shape[-2:]
        if isinstance(self.size, int):
            scale = self.size / min(height, width)
            target = (round(height * scale), round(width * scale))
        else:
            target = (int(self.size[0]), int(self.size[1]))
        return F.interpolate(image.unsqueeze(0), size=target, mode="bilinear", align_corners=False).squeeze(0)


class CenterCrop:
    def __init__(self, size: int | Sequence[int]) -> None:
        self.size = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        if image.dtype == torch.uint8:
            return _on_image(self, image)
        height, width = image.shape[-2:]
        top, left = (height - self.size[0]) // 2, (width - self.size[1]) // 2
        return image[..., top : top + self.size[0], left : left + self.size[1]]


def _on_image(transform: Callable[[torch.Tensor], torch.Tensor], image: torch.Tensor) -> torch.Tensor:
    """Apply a CHW transform to a uint8 HWC image and give back a uint8 HWC image (PIL in, PIL out)."""
    out = transform(image.permute(2, 0, 1).to(torch.float32))
    return out.round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).contiguous()
