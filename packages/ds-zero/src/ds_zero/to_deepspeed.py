"""Write a ds checkpoint (any ZeRO stage, any world size) as one DeepSpeed 0.19.8 loads.

Command line::

    python -m ds_zero.to_deepspeed CHECKPOINT_DIR OUTPUT_DIR [-t TAG] [--world_size N] [--stage S]

`CHECKPOINT_DIR` is ds's save directory (holding `latest`); `OUTPUT_DIR` receives DeepSpeed's tree:
`latest`, `<tag>/mp_rank_00_model_states.pt` (stage 3: `zero_pp_rank_{r}_mp_rank_00_model_states.pt`
for every rank, the partitioned parameters as empty tensors, as DeepSpeed writes them) and
`<tag>/[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt` in DeepSpeed's per-rank layout, with
`ds_version`, `param_shapes`, `frozen_param_shapes` and DeepSpeed's class paths for the loss scaler,
`ZeroStageEnum` and `fragment_address`, plus ds's torch-only `zero_to_fp32.py` and `zero_to_torch.py`. DeepSpeed loads
ZeRO files only at the world size they were written for: `--world_size` picks it (default: the
world size of the ds save), `--stage` the ZeRO stage (default: the saved one).

Every model-parallel rank of the save is written: a pipeline checkpoint's stages (`mp_rank_{stage:02d}`
files, each stage's optimizer partitions over its own data-parallel ranks, `--world_size` being the
data-parallel degree) with its `layer_XX-model_states.pt` weight files copied as they are (ds writes
DeepSpeed's layer files). DeepSpeed's pipeline engine takes ZeRO stage 0 or 1 only.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ds_zero._checkpoint.deepspeed_convert import convert_to_deepspeed

__all__ = ["convert_to_deepspeed", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m ds_zero.to_deepspeed CHECKPOINT_DIR OUTPUT_DIR`: returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m ds_zero.to_deepspeed", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint_dir", help="ds's save directory (holding 'latest')")
    parser.add_argument("output_dir", help="where DeepSpeed's layout is written")
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag (default: read from 'latest')")
    parser.add_argument("--world_size", type=int, default=None, help="DeepSpeed's data-parallel world size")
    parser.add_argument("--stage", type=int, default=None, choices=(1, 2, 3), help="DeepSpeed's ZeRO stage")
    args = parser.parse_args(argv)
    try:
        out = convert_to_deepspeed(
            args.checkpoint_dir, args.output_dir, tag=args.tag, world_size=args.world_size, stage=args.stage
        )
    except (FileNotFoundError, ValueError) as err:
        print(f"to_deepspeed: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote DeepSpeed checkpoint {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
