"""`torchvision.models` for the pipeline example: its AlexNet is the program's own `alexnet.py` (the same network).

Resolved on first use, so a program without that file can still `import torchvision`.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "AlexNet":
        from alexnet import AlexNet  # the program folder's copy of torchvision's AlexNet

        return AlexNet
    if name == "vgg19":
        return _not_offline
    raise AttributeError(f"the offline torchvision stand-in has no models.{name}")


def _not_offline(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("the offline torchvision stand-in builds AlexNet only (from the program's alexnet.py)")
