"""Command-line lr-schedule flags (DeepSpeed's "Convergence Tuning" group) and the `scheduler` section they imply.

`add_tuning_arguments(parser)` adds one flag per schedule parameter with DeepSpeed's names and defaults;
`get_config_from_args(args)` turns parsed flags into a `{"type": ..., "params": {...}}` section holding only the
parameters of the named schedule. Flags left at `None` are not copied, so the schedule's own default applies.
"""

from __future__ import annotations

import argparse
from typing import Any

from ds_engine._optim import lr_schedule_names as names

__all__ = [
    "add_tuning_arguments",
    "get_config_from_args",
    "override_1cycle_params",
    "override_lr_range_test_params",
    "override_params",
    "override_warmupLR_params",
    "parse_arguments",
]

# (flag, type, default, help) per schedule family; the flag is also the params key.
_LR_RANGE_TEST_FLAGS: list[tuple[str, Any, Any, str]] = [
    (names.LR_RANGE_TEST_MIN_LR, float, 0.001, "starting lr of the range test"),
    (names.LR_RANGE_TEST_STEP_RATE, float, 1.0, "lr growth per step_size steps"),
    (names.LR_RANGE_TEST_STEP_SIZE, int, 1000, "training steps per lr change"),
    (names.LR_RANGE_TEST_STAIRCASE, bool, False, "grow the lr in whole stairs"),
]
_ONE_CYCLE_FLAGS: list[tuple[str, Any, Any, str]] = [
    (names.CYCLE_FIRST_STEP_SIZE, int, 1000, "steps of the cycle's rising half"),
    (names.CYCLE_FIRST_STAIR_COUNT, int, -1, "stairs in the rising half"),
    (names.CYCLE_SECOND_STEP_SIZE, int, -1, "steps of the falling half (default: the first's)"),
    (names.CYCLE_SECOND_STAIR_COUNT, int, -1, "stairs in the falling half"),
    (names.DECAY_STEP_SIZE, int, 1000, "steps between decays after the cycle"),
    (names.CYCLE_MIN_LR, float, 0.01, "lower lr bound of the cycle"),
    (names.CYCLE_MAX_LR, float, 0.1, "upper lr bound of the cycle"),
    (names.DECAY_LR_RATE, float, 0.0, "lr decay rate after the cycle"),
    (names.CYCLE_MIN_MOM, float, 0.8, "lower momentum bound of the cycle"),
    (names.CYCLE_MAX_MOM, float, 0.9, "upper momentum bound of the cycle"),
    (names.DECAY_MOM_RATE, float, 0.0, "momentum decay rate after the cycle"),
]
_WARMUP_FLAGS: list[tuple[str, Any, Any, str]] = [
    (names.WARMUP_MIN_LR, float, 0, "lr at the start of warmup"),
    (names.WARMUP_MAX_LR, float, 0.001, "lr at the end of warmup"),
    (names.WARMUP_NUM_STEPS, int, 1000, "warmup length in steps"),
    (names.WARMUP_TYPE, str, names.WARMUP_LOG_RATE, "warmup curve: 'log' or 'linear'"),
]
_COSINE_FLAGS: list[tuple[str, Any, Any, str]] = [
    (names.WARMUP_MIN_RATIO, float, 0.01, "WarmupCosineLR: start of warmup as a fraction of the lr"),
    (names.COS_MIN_RATIO, float, 0.01, "WarmupCosineLR: floor of the cosine as a fraction of the lr"),
]


def add_tuning_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `Convergence Tuning` group (`--lr_schedule` and every schedule parameter) and return `parser`."""
    group = parser.add_argument_group("Convergence Tuning", "Convergence tuning configurations")
    group.add_argument(f"--{names.LR_SCHEDULE}", type=str, default=None, help="lr schedule for training")
    for flag, kind, default, text in _LR_RANGE_TEST_FLAGS + _ONE_CYCLE_FLAGS + _WARMUP_FLAGS + _COSINE_FLAGS:
        group.add_argument(f"--{flag}", type=kind, default=default, help=text)
    # Parsed but, as in DeepSpeed, never copied into the section: OneCycle's own default applies.
    group.add_argument("--cycle_momentum", default=False, action="store_true", help="cycle momentum with the lr")
    return parser


def parse_arguments() -> tuple[argparse.Namespace, list[str]]:
    """Parse `sys.argv` for the tuning flags only: `(known, unknown)`."""
    return add_tuning_arguments(argparse.ArgumentParser()).parse_known_args()


def _copy_set(args: argparse.Namespace, params: dict[str, Any], flags: list[tuple[str, Any, Any, str]]) -> None:
    for flag, *_ in flags:
        value = getattr(args, flag, None)
        if value is not None:
            params[flag] = value


def override_lr_range_test_params(args: argparse.Namespace, params: dict[str, Any]) -> None:
    """Copy the LRRangeTest flags that are set in `args` into `params`."""
    _copy_set(args, params, _LR_RANGE_TEST_FLAGS)


def override_1cycle_params(args: argparse.Namespace, params: dict[str, Any]) -> None:
    """Copy the OneCycle flags that are set in `args` into `params`."""
    _copy_set(args, params, _ONE_CYCLE_FLAGS)


def override_warmupLR_params(args: argparse.Namespace, params: dict[str, Any]) -> None:  # noqa: N802 - DeepSpeed's name
    """Copy the WarmupLR flags that are set in `args` into `params`."""
    _copy_set(args, params, _WARMUP_FLAGS)


def override_params(args: argparse.Namespace, params: dict[str, Any]) -> None:
    """Copy every schedule family's set flags into `params`."""
    override_lr_range_test_params(args, params)
    override_1cycle_params(args, params)
    override_warmupLR_params(args, params)


def get_config_from_args(args: argparse.Namespace) -> tuple[dict[str, Any] | None, str | None]:
    """The `scheduler` section `--lr_schedule` and its flags describe: `(section, None)` or `(None, reason)`."""
    schedule = getattr(args, names.LR_SCHEDULE, None)
    if schedule is None:
        return None, f"--{names.LR_SCHEDULE} not specified on command line"
    if schedule not in names.VALID_LR_SCHEDULES:
        return None, f"{schedule} is not supported LR schedule"
    params: dict[str, Any] = {}
    if schedule == names.LR_RANGE_TEST:
        override_lr_range_test_params(args, params)
    elif schedule == names.ONE_CYCLE:
        override_1cycle_params(args, params)
    else:
        override_warmupLR_params(args, params)
    return {"type": schedule, "params": params}, None
