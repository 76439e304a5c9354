"""`deepspeed.runtime.zero.partition_parameters`: the stage-3 construction API (`Init`, `GatheredParameters`...).

ds-zero's names (looked up on ds-zero itself), plus DeepSpeed's tensor-constructor hook as a module
attribute: `zero_wrapper_for_fp_tensor_constructor(fn, target_fp_dtype, target_device=None)` returns
`fn` made to create floating-point tensors in `target_fp_dtype` on `target_device`, and `_orig_torch_arange`
is torch's own `arange`. Hugging Face swaps the hook around `from_pretrained` so that RoPE buffers built
with `torch.arange` keep their dtype (`prevent_arange_dtype_change`); it saves, replaces and restores
this attribute, so it must exist. ds-zero's `Init` casts parameters as it partitions them and leaves
tensor constructors (and buffers) alone, so there is no dtype change for the swap to prevent: the hook
is not on ds's construction path, and swapping it changes nothing in ds.

`print_rank_0(message, debug=False, force=False)` is DeepSpeed's debug printer of this module: it prints
on global rank 0 when `debug` or `force` is set (ds-zero logs through `logging` instead; scripts and tests
call or replace this one).

`_contradicting_single_rank_pg_error(dp_world_size, explicit_process_group, env=None)` is DeepSpeed's name of
the check `zero.Init` runs before partitioning (ds-zero's `single_rank_group_error`): a message when the
group it found has one rank, was not passed explicitly, and the launcher's `WORLD_SIZE` is above one.

`zero3_linear_wrap` is DeepSpeed's stage-3 linear (ds-zero's, the object `deepspeed.runtime.zero.linear`
re-exports and that `zero.Init` installs over `torch.nn.functional.linear` under
`zero_optimization.memory_efficient_linear`).

`partitioned_param_data_shape` is DeepSpeed's constant for the shape of a released parameter's `data`
(`[0]` there). ds keeps a released parameter at its logical shape (a one-element NaN tensor expanded to
`ds_shape`, see ds_zero's partitioned_param module), so in ds the constant describes DeepSpeed, not the
parameters: code that needs the released state should test `param.ds_status`, and the full shape is
`param.ds_shape` in both.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch

import ds_comm
from ds_comm import get_accelerator
from ds_engine._reexport import optional_reexport
from ds_engine.runtime.zero.linear import zero3_linear_wrap

_zero_all, __getattr__, _zero_dir = optional_reexport(
    "ds_engine.runtime.zero.partition_parameters",
    "ds_zero",
    extra="zero",
    feature="ds_engine.runtime.zero.partition_parameters (deepspeed.runtime.zero.partition_parameters, ZeRO-3)",
)

#: DeepSpeed's shape of a released stage-3 parameter's `data` (ds keeps the logical shape; see above).
partitioned_param_data_shape = [0]

#: torch's own constructors, kept before anything could wrap them (DeepSpeed's names for them). DeepSpeed's
#: `Init` wraps the tensor factories and puts these back on exit; ds-zero's `Init` leaves the factories alone
#: (it casts and places parameters as it partitions them), so replacing these changes nothing in ds.
_orig_torch_arange = torch.arange
_orig_torch_empty = torch.empty

__all__ = [
    *_zero_all,
    "get_accelerator",
    "partitioned_param_data_shape",
    "print_rank_0",
    "zero3_linear_wrap",
    "zero_wrapper_for_fp_tensor_constructor",
]


def print_rank_0(message: str, debug: bool = False, force: bool = False) -> None:
    """Print `message` on global rank 0 when `debug` or `force` (otherwise nothing)."""
    if ds_comm.get_rank() == 0 and (debug or force):
        print(message)


def zero_wrapper_for_fp_tensor_constructor(
    fn: Callable[..., torch.Tensor], target_fp_dtype: torch.dtype, target_device: torch.device | str | None = None
) -> Callable[..., torch.Tensor]:
    """`fn` (a tensor constructor such as `torch.empty`) that puts its result on `target_device` and casts a
    floating-point result to `target_fp_dtype`; a `device=` passed by the caller wins.

    Args:
        fn: the constructor to wrap.
        target_fp_dtype: the dtype floating-point results are cast to.
        target_device: where results are created (None: the accelerator's current device).
    """
    device = torch.device(target_device) if target_device is not None else get_accelerator().device()

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None:
            kwargs["device"] = device
        tensor = fn(*args, **kwargs)
        return tensor.to(target_fp_dtype) if tensor.is_floating_point() else tensor

    return wrapped


def _contradicting_single_rank_pg_error(
    dp_world_size: int, explicit_process_group: object | None, env: Mapping[str, str | None] | None = None
) -> str | None:
    """DeepSpeed's name of the check `zero.Init` runs on its group: `ds_zero.single_rank_group_error`.

    The message for a one-rank group that was not passed explicitly while the launcher's `WORLD_SIZE` is
    above one (parameters would stay whole on every rank), else None.
    """
    return __getattr__("single_rank_group_error")(dp_world_size, explicit_process_group, env)


def __dir__() -> list[str]:  # noqa: N807 - the PEP 562 hook
    return sorted(
        {
            *_zero_dir(),
            "_contradicting_single_rank_pg_error",
            "_orig_torch_arange",
            "get_accelerator",
            "print_rank_0",
            "partitioned_param_data_shape",
            "zero3_linear_wrap",
            "zero_wrapper_for_fp_tensor_constructor",
        }
    )
