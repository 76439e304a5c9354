"""`deepspeed.nvme.ds_aio_args`: `ds_io`'s command line, DeepSpeed 0.19.8's flags with its defaults.

`parse_arguments` reads every flag DeepSpeed's `ds_io` reads; `refine_args` turns the size strings ("400M")
into bytes; `validate_args` checks them all at once and prints each problem naming its flag (DeepSpeed's
checks, plus two it leaves to a crash later: `--gpu` without a CUDA device, and a size that is not a
number); `get_validated_args` does the three and adds the run's plan: `total_loops` (warm-up + timed),
`mapping_dict` / `mapping_list` (which task does its I/O in which folder, with which device: `--folder` with
`--multi_process N` gives N tasks in one folder, `--folder_to_device_mapping DIR:DEV ...` one task per entry).
Where DeepSpeed prints the problems and exits with status 0, `get_validated_args` exits with status 2.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

from ds_ops.nvme.ds_aio_constants import AIO_HANDLE, TORCH_IO, VALID_ENGINES
from ds_ops.nvme.test_ds_aio_utils import refine_integer_value

__all__ = [
    "MAPPING_DELIMITER",
    "get_validated_args",
    "parse_arguments",
    "refine_args",
    "validate_args",
]

MAPPING_DELIMITER = ":"
_SIZE_FLAGS = ("io_size", "block_size", "fast_io_size")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds_io", description="Time file reads or writes through DeepNVMe's engines.")
    p.add_argument("--folder", default=None, type=str, help="directory to do the I/O in")
    p.add_argument(
        "--folder_to_device_mapping",
        default=[],
        nargs="+",
        help="FOLDER:DEVICE_ID entries, one task each (with --gpu, the device's memory is the buffer)",
    )
    p.add_argument("--io_size", type=str, default=None, required=True, help="bytes per read or write (K/M/G suffix)")
    p.add_argument("--fast_io_size", type=str, default="64M", help="torch_fastio's pinned buffer bytes")
    p.add_argument("--read", action="store_true", help="time reads (default: writes)")
    p.add_argument("--multi_process", type=int, default=1, help="tasks doing I/O in --folder at once")
    p.add_argument("--block_size", type=str, default="1M", help="bytes per kernel request (K/M/G suffix)")
    p.add_argument("--queue_depth", type=int, default=32, help="requests in flight")
    p.add_argument("--single_submit", action="store_true", help="submit requests one at a time")
    p.add_argument(
        "--sequential_requests", action="store_true", help="submit only after the previous requests complete"
    )
    p.add_argument("--validate", action="store_true", help="check the bytes moved against the file")
    p.add_argument("--engine", type=str, default=AIO_HANDLE, help=f"one of {', '.join(VALID_ENGINES)}")
    p.add_argument("--loops", type=int, default=3, help="timed repetitions")
    p.add_argument("--io_parallel", type=int, default=None, help="worker threads per request")
    p.add_argument("--gpu", action="store_true", help="the buffer is in accelerator memory")
    p.add_argument("--use_gds", action="store_true", help="GPUDirect Storage (with --gpu)")
    p.add_argument("--slow_bounce_buffer", action="store_true", help="with --gpu: no pinned bounce buffer")
    p.add_argument("--torch_legacy_save", action="store_true", help="torch engines: torch's legacy format")
    p.add_argument("--use_accelerator_pin_memory", action="store_true", help="pin buffers with the accelerator")
    p.add_argument("--warmup_loops", type=int, default=1, help="untimed repetitions first")
    p.add_argument("--include_warmup_time", action="store_true", help="count the warm-up loops in the results")
    p.add_argument("--different_file_each_iteration", action="store_true", help="a new file each loop")
    return p


def parse_arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """`ds_io`'s flags from `argv` (None: the command line)."""
    args = _parser().parse_args(argv)
    print(f"args = {args}")
    return args


def refine_args(args: argparse.Namespace, *, strict: bool = True) -> argparse.Namespace:
    """The size flags as bytes ("64M" -> 67108864); ValueError naming the flag when one is not a size, or, with
    `strict` off, that flag left as given (for `validate_args` to report with the rest)."""
    for name in _SIZE_FLAGS:
        value = getattr(args, name, None)
        if isinstance(value, str) and value:
            try:
                setattr(args, name, refine_integer_value(value))
            except ValueError:
                if strict:
                    raise ValueError(
                        f"--{name} {value!r} is not a size (a number with an optional K, M or G)"
                    ) from None
    return args


def _mapping_errors(args: argparse.Namespace) -> list[str]:
    errors = []
    bad = [m for m in args.folder_to_device_mapping if MAPPING_DELIMITER not in m]
    if bad:
        errors.append(f"--folder_to_device_mapping: {bad} lack the '{MAPPING_DELIMITER}' between folder and device")
    entries = [m.rsplit(MAPPING_DELIMITER, 1) for m in args.folder_to_device_mapping if MAPPING_DELIMITER in m]
    missing = [folder for folder, _ in entries if not os.path.exists(folder)]
    if missing:
        errors.append(f"--folder_to_device_mapping: no such folder(s) {missing}")
    not_ids = [dev for _, dev in entries if not dev.isdigit()]
    if not_ids:
        errors.append(f"--folder_to_device_mapping: device ids {not_ids} are not numbers")
    elif args.gpu:
        count = _cuda_count()
        beyond = [int(dev) for _, dev in entries if int(dev) >= count]
        if beyond:
            errors.append(f"--folder_to_device_mapping: device ids {beyond} beyond the {count} devices here")
    return errors


def _cuda_count() -> int:
    import torch  # noqa: PLC0415 - only where --gpu asks

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def validate_args(args: argparse.Namespace) -> bool:
    """Whether the flags make a run; otherwise prints every problem, each naming its flag."""
    errors: list[str] = []
    if args.folder is not None and args.folder_to_device_mapping:
        errors.append("--folder and --folder_to_device_mapping cannot be given together")
    elif args.folder is None and not args.folder_to_device_mapping:
        errors.append("give --folder or --folder_to_device_mapping")
    if args.folder is not None and not os.path.exists(args.folder):
        errors.append(f"--folder {args.folder}: no such folder")
    if args.folder_to_device_mapping:
        errors += _mapping_errors(args)
    if args.multi_process < 1:
        errors.append(f"--multi_process {args.multi_process}: at least 1 task")
    if args.engine not in VALID_ENGINES:
        errors.append(f"--engine {args.engine}: not one of {VALID_ENGINES}")
    elif args.engine == TORCH_IO and args.read:
        errors.append(f"--read: --engine {TORCH_IO} times writes only")
    if args.use_gds and not args.gpu:
        errors.append("--use_gds needs --gpu (GPUDirect Storage moves device memory)")
    if args.gpu and _cuda_count() == 0:
        errors.append("--gpu: no CUDA device here; drop --gpu to time host memory")
    for name in ("io_size", "block_size", "fast_io_size"):
        value = getattr(args, name)
        if not isinstance(value, int) or value < 1:
            errors.append(f"--{name} {value!r}: not a size of at least 1 byte (a number with an optional K, M or G)")
    if errors:
        print(f"Found {len(errors)} validation error(s)")
        for i, msg in enumerate(errors, 1):
            print(f"{i}: {msg}")
    return not errors


def _mapping(args: argparse.Namespace) -> dict[Any, str]:
    if args.folder is not None:
        return {i: args.folder for i in range(args.multi_process)}
    return {int(dev): folder for folder, dev in (m.rsplit(MAPPING_DELIMITER, 1) for m in args.folder_to_device_mapping)}


def get_validated_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse, refine and validate `ds_io`'s flags and add the run's plan (module docstring).

    Raises:
        SystemExit: status 2 after printing what is wrong with the flags.
    """
    args = parse_arguments(argv)
    refine_args(args, strict=False)
    if not validate_args(args):
        raise SystemExit(2)
    print("Successful validation of command line arguments")
    args.total_loops = args.warmup_loops + args.loops
    args.mapping_dict = _mapping(args)
    args.mapping_list = list(args.mapping_dict.items())
    peer = "gpu" if args.gpu else "process"
    print(f"Configuring {len(args.mapping_list)} {peer} to folder mapping")
    for i, (device_id, folder) in enumerate(args.mapping_list):
        print(f"[{i}]: {peer} {device_id} <----> {folder}")
    return args
