"""An offline stand-in for the parts of torchvision the DeepSpeedExamples programs use.

Nothing can be downloaded on the hosts tools/deepspeed_examples.py runs on, and torchvision is not
installed beside either side's torch: the programs' `torchvision.datasets.CIFAR10` becomes a seeded
synthetic set of the same shapes (see `datasets`), and `transforms` does the tensor work of the
transforms they compose. The copy is written next to the program, so `import torchvision` finds it first.
"""

from __future__ import annotations

from . import datasets, transforms

__all__ = ["datasets", "transforms"]
