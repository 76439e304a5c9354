"""`deepspeed.checkpoint.ds_to_universal`: ds-zero's universal-checkpoint converter under DeepSpeed's module path.

`python -m deepspeed.checkpoint.ds_to_universal --input_folder ... --output_folder ...` (or
`python -m ds_engine.checkpoint.ds_to_universal`, or the `ds_to_universal` command) runs
`ds_zero.ds_to_universal.main`. Needs the `zero` extra: without ds-zero, importing this module raises
ImportError naming `pip install 'ds-engine[zero]'`.

`main(args)` is DeepSpeed's entry point: `args` the namespace of its arguments (`input_folder`,
`output_folder`, `num_extract_workers`, `num_merge_workers`, `keep_temp_folder`, `strict`,
`inject_missing_state`). It checks the checkpoint as DeepSpeed does, in DeepSpeed's order and through
these module-level steps (`_get_optim_files`, `_filter_zero3_optim_files`, `_get_zero_stage`, then for
ZeRO 1/2 `DeepSpeedCheckpoint`, `_inject_missing_state` and `_check_for_required_state`, which refuses
parameters the saving AutoTP marked unconvertible, `_validate_autotp_conversion_support`), then converts
with ds-zero's converter; it raises instead of returning an exit status. DeepSpeed's file-level merge
steps are ds-zero's too: `merge_tp_slices` (saving a fused projection's sections as DeepSpeed's
`SubparamShape`), `_merge_zero_shards`, `_group_per_tp_shapes`.

`_aggregate_autoep_zero12_metadata(DeepSpeedCheckpoint(dir).model_state_metadata)` is DeepSpeed's
private check of the model-states summaries before a ZeRO-1/2 conversion (`model_state_metadata.py`).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ds_engine._checkpoint.offline.universal_steps import (
    _check_for_required_state,
    _filter_zero3_optim_files,
    _get_optim_files,
    _get_zero_stage,
    _inject_missing_state,
    _validate_autotp_conversion_support,  # noqa: F401 - DeepSpeed's name, used by `_check_for_required_state`
)
from ds_engine._reexport import optional_reexport
from ds_engine.checkpoint.deepspeed_checkpoint import DeepSpeedCheckpoint
from ds_engine.checkpoint.model_state_metadata import (
    aggregate_autoep_zero12_metadata as _aggregate_autoep_zero12_metadata,  # noqa: F401 - DeepSpeed's private name
)
from ds_engine.checkpoint.universal_checkpoint import SubparamShape

if TYPE_CHECKING:  # names are looked up at run time; type checkers see ds_zero's own
    from ds_zero.ds_to_universal import (  # noqa: F401
        UniversalMergeError,
        convert_to_universal,
        group_per_tp_shapes,
        load_universal_partitions,
        merge_zero_shards,
        parse_arguments,
        universal_model_states_file,
    )

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.checkpoint.ds_to_universal",
    "ds_zero.ds_to_universal",
    extra="zero",
    feature="ds_engine.checkpoint.ds_to_universal (deepspeed.checkpoint.ds_to_universal, universal checkpoints)",
)
_converter: Any = importlib.import_module("ds_zero.ds_to_universal")  # imported by optional_reexport above

#: DeepSpeed's private names of ds-zero's file-level steps.
_merge_zero_shards = _converter.merge_zero_shards
_group_per_tp_shapes = _converter.group_per_tp_shapes


def merge_tp_slices(
    uc_info: dict[str, Any],
    dir: str,  # noqa: A002 - DeepSpeed's argument name
    slice_dir: str,
    tp_degree: int,
    name_and_shapes: tuple[str, Sequence[Any]],
) -> set[str]:
    """DeepSpeed's merge of one parameter's fragment files into its universal state files (ds-zero's
    `merge_tp_slices`); a fused projection's `sub_param_shape` is saved as a `SubparamShape`. Returns the
    category patterns this parameter did not use."""
    result: set[str] = _converter.merge_tp_slices(
        uc_info, dir, slice_dir, tp_degree, name_and_shapes, record=lambda fields: SubparamShape(**fields)
    )
    return result


def main(args: Any = None) -> int | None:
    """Convert `args.input_folder` into a universal checkpoint in `args.output_folder` (DeepSpeed's `main`).

    `args` may be any object with those attributes (`types.SimpleNamespace` too). With a command line
    (a list of strings, or None for `sys.argv`) this is the `ds_to_universal` command:
    ds-zero's `main`, which prints the reason and returns 2 when it cannot convert.

    Raises:
        ValueError: parameters the saving AutoTP marked unconvertible, a missing
            `universal_checkpoint_info` (ZeRO 1/2, without `inject_missing_state`; also an AssertionError),
            or a layout the converter refuses.
        FileNotFoundError: not a ZeRO checkpoint tag directory.
    """
    if args is None or isinstance(args, (list, tuple)):
        status: int = _converter.main(args)
        return status
    optim_files = _get_optim_files(args.input_folder)
    zero3_files = _filter_zero3_optim_files(optim_files)
    stage = _get_zero_stage(zero3_files or optim_files)
    if stage <= 2:
        checkpoint = DeepSpeedCheckpoint(args.input_folder)
        if args.inject_missing_state:
            _inject_missing_state(checkpoint)
        _check_for_required_state(checkpoint)
    _converter.convert_to_universal(
        args.input_folder,
        args.output_folder,
        num_extract_workers=getattr(args, "num_extract_workers", 4),
        num_merge_workers=getattr(args, "num_merge_workers", 2),
        keep_temp_folder=getattr(args, "keep_temp_folder", False),
        strict=getattr(args, "strict", True),
        inject_missing_state=getattr(args, "inject_missing_state", False),
    )
    return None


if __name__ == "__main__":  # `python -m ds_engine.checkpoint.ds_to_universal ...`, as DeepSpeed's module runs
    import sys

    from ds_engine._optional import require

    sys.exit(require("ds_zero", extra="zero", feature="ds_to_universal").ds_to_universal.main())
