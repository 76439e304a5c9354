"""Convert a ZeRO checkpoint (DeepSpeed's or ds's) into DeepSpeed's universal checkpoint, from the command line.

    ds_to_universal --input_folder SAVE_DIR/global_step100 --output_folder SAVE_DIR/global_step100_universal \\
        [--num_extract_workers 4] [--num_merge_workers 2] [--keep_temp_folder] [--no_strict] [--inject_missing_state]

(also `python -m ds_zero.ds_to_universal` and DeepSpeed's `python -m deepspeed.checkpoint.ds_to_universal`).
The arguments are DeepSpeed 0.19.8's; `--inject_missing_state` is needed for checkpoints an engine wrote
(they carry no `universal_checkpoint_info`), as with DeepSpeed's converter. The result loads, in ds and in
DeepSpeed, with `"checkpoint": {"load_universal": true}` and `load_checkpoint(SAVE_DIR)` at any world size.

`merge_zero_shards`, `merge_tp_slices` and `group_per_tp_shapes` are DeepSpeed's file-level steps (its
intermediate per-fragment files, see `_checkpoint/slice_files.py`) over the same merge rules.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import ds_comm
from ds_zero._checkpoint.slice_files import group_per_tp_shapes, merge_tp_slices, merge_zero_shards
from ds_zero._checkpoint.sub_param_merge import UniversalMergeError
from ds_zero._checkpoint.universal_read import load_universal_partitions, universal_model_states_file
from ds_zero._checkpoint.universal_write import convert_to_universal

__all__ = [
    "UniversalMergeError",
    "convert_to_universal",
    "group_per_tp_shapes",
    "load_universal_partitions",
    "main",
    "merge_tp_slices",
    "merge_zero_shards",
    "parse_arguments",
    "universal_model_states_file",
]


def parse_arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """DeepSpeed's arguments of `ds_to_universal`."""
    parser = argparse.ArgumentParser(prog="ds_to_universal", description=__doc__.split("\n\n")[0])
    parser.add_argument("--input_folder", required=True, help="the checkpoint's tag directory (ZeRO stage 1-3)")
    parser.add_argument("--output_folder", required=True, help="the universal checkpoint's directory")
    parser.add_argument("--num_extract_workers", type=int, default=4, help="accepted; rank files are read serially")
    parser.add_argument("--num_merge_workers", type=int, default=2, help="threads writing the per-parameter files")
    parser.add_argument("--keep_temp_folder", action="store_true", help="keep OUTPUT_FOLDER/tmp")
    parser.add_argument(
        "--strict", dest="strict", action="store_true", default=True, help="fail on unused patterns (the default)"
    )
    parser.add_argument("--no_strict", dest="strict", action="store_false", help="only warn about unused patterns")
    parser.add_argument(
        "--inject_missing_state",
        action="store_true",
        help="convert a checkpoint without universal_checkpoint_info (any engine checkpoint) with the defaults",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the converter; returns the exit status (2 with the reason on stderr when it cannot convert)."""
    args = parse_arguments(argv)
    try:
        out = convert_to_universal(
            args.input_folder,
            args.output_folder,
            num_extract_workers=args.num_extract_workers,
            num_merge_workers=args.num_merge_workers,
            keep_temp_folder=args.keep_temp_folder,
            strict=args.strict,
            inject_missing_state=args.inject_missing_state,
        )
    except (FileNotFoundError, ValueError, ds_comm.CheckpointFileError) as err:
        print(f"ds_to_universal: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote universal checkpoint {out} (and {out.parent / 'latest_universal'})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
