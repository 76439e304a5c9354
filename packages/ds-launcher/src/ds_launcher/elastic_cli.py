"""`ds_elastic`: DeepSpeed's elasticity calculator, which DeepSpeed 0.19 removed and ds does not implement.

The command stays installed so scripts that call it fail with a message that says so and what to do,
instead of "command not found".
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["MESSAGE", "main"]

MESSAGE = (
    "ds_elastic: elastic training (the `elasticity` config section and its batch-size calculator) was "
    "removed in DeepSpeed 0.19 and is not implemented in ds. Set train_batch_size, "
    "train_micro_batch_size_per_gpu and gradient_accumulation_steps for a fixed world size instead."
)


def main(argv: Sequence[str] | None = None) -> int:
    """Print why the command cannot run and return exit status 2, whatever the arguments."""
    print(MESSAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
