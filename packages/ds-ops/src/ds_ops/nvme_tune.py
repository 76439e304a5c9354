"""`ds_nvme_tune`: sweep the aio settings on a directory and propose the `aio` config section that moves most.

    ds_nvme_tune --nvme_dir /nvme/scratch [--sweep_config sweep.json] [--io_size 400M] [--no_read] [--no_write]
                 [--loops 1] [--log_dir _aio_bench_logs]

Every combination of the sweep's `block_size`, `queue_depth`, `sequential_requests`, `single_submit` and
`io_parallel` lists (DeepSpeed's default sweep unless `--sweep_config` names a JSON file with those keys)
is timed with `ds_io`'s `run_io`, reads and writes. The winner is the combination with the largest read +
write bandwidth (or the one measured, with `--no_read`/`--no_write`). Each measurement is appended to
`<log_dir>/sweep.jsonl` and written as DeepSpeed's per-setting log (`ds_ops.nvme_stats`, which
`parse_nvme_stats` reads), and the proposal is printed as a ds_config `aio` section with ds's key names.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from ds_ops.nvme_bench import parse_size, run_io
from ds_ops.nvme_stats import READ_LOG_DIR, WRITE_LOG_DIR, generate_aio_param, log_file_name, report_lines

__all__ = [
    "DEFAULT_SWEEP_CONFIG",
    "best_aio_config",
    "ds_nvme_tune_main",
    "generate_main",
    "parse_sweep_arguments",
    "sweep",
    "sweep_main",
]

#: DeepSpeed's default sweep: 2 x 2 x 2 x 2 x 4 = 64 settings.
DEFAULT_SWEEP_CONFIG: dict[str, list[Any]] = {
    "block_size": ["1M", "8M"],
    "queue_depth": [32, 128],
    "sequential_requests": [True, False],
    "single_submit": [False, True],
    "io_parallel": [1, 2, 4, 8],
}
BENCH_LOG_DIR = "_aio_bench_logs"


def _settings(sweep_config: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    unknown = sorted(set(sweep_config) - set(DEFAULT_SWEEP_CONFIG))
    if unknown:
        raise ValueError(f"sweep config: unknown keys {unknown}; allowed: {sorted(DEFAULT_SWEEP_CONFIG)}")
    axes = {key: list(sweep_config.get(key, DEFAULT_SWEEP_CONFIG[key])) for key in DEFAULT_SWEEP_CONFIG}
    for key, values in axes.items():
        if not values:
            raise ValueError(f"sweep config: {key!r} needs at least one value")
    return [dict(zip(axes, combo, strict=True)) for combo in itertools.product(*axes.values())]


def sweep(
    nvme_dir: str,
    io_size: int,
    sweep_config: Mapping[str, Sequence[Any]] | None = None,
    *,
    read: bool = True,
    write: bool = True,
    loops: int = 1,
    log_path: str | None = None,
    log_dir: str | None = None,
) -> list[dict[str, Any]]:
    """Time every setting of the sweep; one record per setting with `read_gbps`/`write_gbps` (None if skipped).

    With `log_dir`, each measurement is also written as DeepSpeed's sweep log (`ds_ops.nvme_stats`):
    `<log_dir>/_aio_bench_{read,write}_logs/<setting>.txt`, holding `ds_io`'s speed lines.

    Raises:
        ValueError: bad sweep keys or values, or neither reads nor writes requested.
    """
    if not (read or write):
        raise ValueError("--no_read and --no_write together leave nothing to measure")
    records = []
    for setting in _settings(sweep_config or DEFAULT_SWEEP_CONFIG):
        record: dict[str, Any] = {**setting, "io_size": io_size, "read_gbps": None, "write_gbps": None}
        for kind, wanted in (("read", read), ("write", write)):
            if wanted:
                result = run_io(
                    nvme_dir,
                    io_size,
                    read=kind == "read",
                    block_size=parse_size(setting["block_size"]),
                    queue_depth=int(setting["queue_depth"]),
                    single_submit=bool(setting["single_submit"]),
                    overlap_events=not setting["sequential_requests"],
                    intra_op_parallelism=int(setting["io_parallel"]),
                    loops=loops,
                )
                record[f"{kind}_gbps"] = result.best_gbps
                if log_dir is not None:
                    _write_log(log_dir, kind, setting, result.num_bytes, min(result.seconds))
        records.append(record)
        if log_path is not None:
            with open(log_path, "a") as f:
                f.write(json.dumps(record) + "\n")
    return records


def _write_log(log_dir: str, kind: str, setting: Mapping[str, Any], num_bytes: int, seconds: float) -> None:
    folder = os.path.join(log_dir, READ_LOG_DIR if kind == "read" else WRITE_LOG_DIR)
    os.makedirs(folder, exist_ok=True)
    name = log_file_name(
        kind,
        block_size=setting["block_size"],
        queue_depth=int(setting["queue_depth"]),
        single_submit=bool(setting["single_submit"]),
        sequential_requests=bool(setting["sequential_requests"]),
        io_parallel=int(setting["io_parallel"]),
    )
    with open(os.path.join(folder, name), "w") as f:
        f.write("\n".join(report_lines(kind == "read", num_bytes, seconds)) + "\n")


def best_aio_config(records: Sequence[Mapping[str, Any]]) -> tuple[dict[str, Any], Mapping[str, Any]]:
    """The `{"aio": {...}}` section for the record with the largest read + write bandwidth, and that record."""
    if not records:
        raise ValueError("no measurements to choose from")
    best = max(records, key=lambda r: (r["read_gbps"] or 0.0) + (r["write_gbps"] or 0.0))
    section = {
        "aio": {
            "block_size": parse_size(best["block_size"]),
            "queue_depth": int(best["queue_depth"]),
            "intra_op_parallelism": int(best["io_parallel"]),
            "single_submit": bool(best["single_submit"]),
            "overlap_events": not best["sequential_requests"],
        }
    }
    return section, best


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds_nvme_tune", description="Find the aio settings that move most data.")
    p.add_argument("--nvme_dir", nargs="+", required=True, help="writable directories on the NVMe devices")
    p.add_argument("--sweep_config", default=None, help="JSON file with lists per sweep key (default: DeepSpeed's)")
    p.add_argument("--io_size", default="400M", help="bytes per read or write (default %(default)s)")
    p.add_argument("--no_read", action="store_true", help="do not measure reads")
    p.add_argument("--no_write", action="store_true", help="do not measure writes")
    p.add_argument("--loops", type=int, default=1, help="timed repetitions per setting (default %(default)s)")
    p.add_argument("--log_dir", default=BENCH_LOG_DIR, help="where sweep.jsonl is written (default %(default)s)")
    return p


def parse_sweep_arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """`ds_nvme_tune`'s arguments (DeepSpeed's `deepspeed.nvme.parse_sweep_arguments`)."""
    return _parser().parse_args(argv)


def sweep_main(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run the sweep `args` describe on every `--nvme_dir`, writing the logs under `args.log_dir`."""
    config = None
    if args.sweep_config is not None:
        with open(args.sweep_config) as f:
            config = json.load(f)
    os.makedirs(args.log_dir, exist_ok=True)
    records = []
    for nvme_dir in args.nvme_dir:
        records += sweep(
            nvme_dir,
            parse_size(args.io_size),
            config,
            read=not args.no_read,
            write=not args.no_write,
            loops=args.loops,
            log_path=os.path.join(args.log_dir, "sweep.jsonl"),
            log_dir=args.log_dir,
        )
    return records


def generate_main(log_dir: str) -> dict[str, Any]:
    """Print and return the `aio` section the sweep logs under `log_dir` propose (read and write logs both)."""
    section, read, write = generate_aio_param(os.path.join(log_dir, READ_LOG_DIR), os.path.join(log_dir, WRITE_LOG_DIR))
    print(f"Best performance (GB/sec): read = {read:5.2f}, write = {write:5.2f}")
    print(json.dumps(section, indent=3))
    return section


def ds_nvme_tune_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `ds_nvme_tune`; returns the exit status."""
    args = parse_sweep_arguments(argv)
    try:
        print(f"Running aio performance tuning on {' '.join(args.nvme_dir)}")
        section, best = best_aio_config(sweep_main(args))
    except (OSError, ValueError) as err:
        print(f"ds_nvme_tune: {err}", file=sys.stderr)
        return 2
    read, write = best["read_gbps"], best["write_gbps"]
    print(
        f"Best performance (GB/sec): read = {read if read is None else f'{read:5.2f}'}, "
        f"write = {write if write is None else f'{write:5.2f}'}"
    )
    print(json.dumps(section, indent=3))
    return 0


if __name__ == "__main__":
    sys.exit(ds_nvme_tune_main())
