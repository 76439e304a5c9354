"""Consolidate a ZeRO checkpoint into fp32, fp16 or bf16 weights: DeepSpeed's `zero_to_torch` command line.

    python -m ds_zero.zero_to_torch CHECKPOINT_DIR OUTPUT_DIR --dtype {bf16,bfloat16,float16,float32,fp16,fp32}
                                    [--max_shard_size 5GB] [--safe_serialization] [-t TAG]
                                    [--exclude_frozen_parameters] [-q] [-d]

`ds-zero-to-fp32` with a required `--dtype`: every floating-point tensor (buffers too) is written in it,
as DeepSpeed 0.19.8's `zero_to_torch.py` does. The torch-only copy in each save directory,
`zero_to_torch.py`, takes the same arguments.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from ds_zero.zero_to_fp32 import run_consolidation_cli

__all__ = ["main"]


def main(args: Sequence[str] | None = None) -> int:
    """`python -m ds_zero.zero_to_torch CHECKPOINT_DIR OUTPUT_DIR --dtype DTYPE [...]`: returns the exit status."""
    return run_consolidation_cli(args, prog="zero_to_torch", description=__doc__.split("\n\n")[0], with_dtype=True)


if __name__ == "__main__":
    sys.exit(main())
