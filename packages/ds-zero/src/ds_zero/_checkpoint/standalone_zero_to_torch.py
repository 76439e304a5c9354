#!/usr/bin/env python
"""Consolidated weights of a ZeRO checkpoint in fp32, fp16 or bf16: needs only torch (copied next to each checkpoint).

    python zero_to_torch.py CHECKPOINT_DIR OUTPUT_DIR --dtype {bf16,bfloat16,float16,float32,fp16,fp32}
                            [--max_shard_size 5GB] [--safe_serialization] [-t TAG]
                            [--exclude_frozen_parameters] [-d]

DeepSpeed's arguments and output: what `zero_to_fp32.py` (the script beside this one, which does the
reading) writes, with every floating-point tensor, buffers included, in `--dtype`.

This file is written by ds (ds-zero's `_checkpoint/standalone_zero_to_torch.py`); it must stay free of ds imports.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path


def _zero_to_fp32():
    """The `zero_to_fp32.py` beside this file (ds-zero's package names it `standalone_zero_to_fp32.py`)."""
    here = Path(__file__).resolve().parent
    path = next((p for p in (here / "zero_to_fp32.py", here / "standalone_zero_to_fp32.py") if p.is_file()), None)
    if path is None:
        raise SystemExit(f"zero_to_torch: {here / 'zero_to_fp32.py'} is missing; it does the reading")
    spec = importlib.util.spec_from_file_location("zero_to_fp32", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(args=None):
    zero_to_fp32 = _zero_to_fp32()
    parser = argparse.ArgumentParser(description="Convert a ZeRO checkpoint to float32, float16 or bfloat16 weights.")
    zero_to_fp32.add_common_arguments(parser)
    parser.add_argument("--dtype", required=True, choices=sorted(zero_to_fp32.OUTPUT_DTYPE_NAMES), help="output dtype")
    parsed = parser.parse_args(args)
    zero_to_fp32.debug = parsed.debug
    zero_to_fp32.convert_zero_checkpoint_to_state_dict(
        parsed.checkpoint_dir,
        parsed.output_dir,
        dtype=parsed.dtype,
        max_shard_size=parsed.max_shard_size,
        safe_serialization=parsed.safe_serialization,
        tag=parsed.tag,
        exclude_frozen_parameters=parsed.exclude_frozen_parameters,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
