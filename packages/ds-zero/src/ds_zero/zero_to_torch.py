"""Consolidate a ZeRO checkpoint into fp32, fp16 or bf16 weights: DeepSpeed's `zero_to_torch` command line.

    python -m ds_zero.zero_to_torch CHECKPOINT_DIR OUTPUT_DIR --dtype {bf16,bfloat16,float16,float32,fp16,fp32}
                                    [--max_shard_size 5GB] [--safe_serialization] [-t TAG]
                                    [--exclude_frozen_parameters] [-q] [-d]

`ds-zero-to-fp32` with a required `--dtype`: every floating-point tensor (buffers too) is written in it,
as DeepSpeed 0.19.8's `zero_to_torch.py` does. The torch-only copy in each save directory,
`zero_to_torch.py`, takes the same arguments.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from ds_zero.zero_to_fp32 import _DTYPES, convert_zero_checkpoint_to_state_dict

__all__ = ["main"]


def main(args: Sequence[str] | None = None) -> int:
    """`python -m ds_zero.zero_to_torch CHECKPOINT_DIR OUTPUT_DIR --dtype DTYPE [...]`: returns the exit status."""
    parser = argparse.ArgumentParser(prog="zero_to_torch", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint_dir", help="save directory holding 'latest' (or a tag directory)")
    parser.add_argument("output_dir", help="directory for pytorch_model.bin (or shards and an index)")
    parser.add_argument("--dtype", required=True, choices=sorted(_DTYPES), help="output tensor dtype")
    parser.add_argument("--max_shard_size", default="5GB", help="largest shard, e.g. 5GB or 500MiB (default 5GB)")
    parser.add_argument("--safe_serialization", action="store_true", help="write model.safetensors")
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag (default: read from 'latest')")
    parser.add_argument("--exclude_frozen_parameters", action="store_true", help="leave out frozen parameters")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    parser.add_argument("-d", "--debug", action="store_true", help="debug logging")
    parsed = parser.parse_args(args)
    if parsed.debug:
        logging.basicConfig(level=logging.DEBUG)
    try:
        out = convert_zero_checkpoint_to_state_dict(
            parsed.checkpoint_dir,
            parsed.output_dir,
            dtype=parsed.dtype,
            max_shard_size=parsed.max_shard_size,
            safe_serialization=parsed.safe_serialization,
            tag=parsed.tag,
            exclude_frozen_parameters=parsed.exclude_frozen_parameters,
            progress=not parsed.quiet,
        )
    except (FileNotFoundError, ValueError, ImportError) as err:
        print(f"zero_to_torch: error: {err}", file=sys.stderr)
        return 2
    if not parsed.quiet:
        print(f"saved {parsed.dtype} state_dict to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
