"""`deepspeed.runtime.zero.utils`: DeepSpeed's ZeRO helper module, for code and tests that import from it.

- `ZeRORuntimeException`: the exception type DeepSpeed's ZeRO code and users' `except` clauses name.
- `ZERO_SUPPORTED_OPTIMIZERS` / `is_zero_supported_optimizer`: the optimizer classes ZeRO was tested
  with (an exact-type check, as DeepSpeed's; anything else still runs under `zero_allow_untested_optimizer`).
- Rank agreement checks (`assert_ints_same_as_other_ranks`, `get_lst_from_rank0`,
  `assert_lst_len_same_as_other_ranks`): a broadcast from rank 0 and an error naming both ranks' values,
  so a divergence shows up as a message instead of a hang in a later collective.
- Tree helpers (`apply_to_tensors_only`, `isinstance_namedtuple`, `is_builtin_type`, `is_zero_param`)
  and flat-buffer helpers (`get_mapping_to_flat_buffer`, `defragment`).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

import ds_comm
from ds_comm import get_accelerator
from ds_engine._optim.optimizers import zero_supported_optimizer_classes

__all__ = [
    "ZERO_SUPPORTED_OPTIMIZERS",
    "ZeRORuntimeException",
    "apply_to_tensors_only",
    "assert_ints_same_as_other_ranks",
    "assert_lst_len_same_as_other_ranks",
    "defragment",
    "get_lst_from_rank0",
    "get_mapping_to_flat_buffer",
    "get_norm_dtype",
    "is_builtin_type",
    "is_zero_param",
    "is_zero_supported_optimizer",
    "isinstance_namedtuple",
]

logger = logging.getLogger("DeepSpeed")


class ZeRORuntimeException(Exception):
    """A ZeRO usage error at run time (DeepSpeed's name)."""


#: Optimizer classes ZeRO is tested with; `is_zero_supported_optimizer` checks the exact type, as DeepSpeed
#: does (the engine's own check, `zero_allow_untested_optimizer`'s, is ds's wider isinstance one).
ZERO_SUPPORTED_OPTIMIZERS: list[type] = list(zero_supported_optimizer_classes())


def get_norm_dtype() -> torch.dtype:
    """The dtype gradient norms accumulate in: float64 where the accelerator has it, else float32."""
    accelerator = get_accelerator()
    supports_fp64 = getattr(accelerator, "is_fp64_supported", lambda: True)()
    return torch.float64 if supports_fp64 else torch.float32


def is_zero_supported_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer`'s exact class is one ZeRO is tested with (subclasses are not)."""
    return type(optimizer) in ZERO_SUPPORTED_OPTIMIZERS


def _rank() -> int:
    return ds_comm.get_rank() if ds_comm.is_initialized() else 0


def _broadcast_from_rank0(values: Sequence[int]) -> list[int]:
    if not ds_comm.is_initialized():  # no process group: this process is rank 0
        return [int(v) for v in values]
    device = torch.device(get_accelerator().current_device_name())
    tensor = torch.tensor(list(values), dtype=torch.int64, device=device)
    ds_comm.broadcast(tensor, src=0)
    return [int(v) for v in tensor.cpu().tolist()]


def assert_lst_len_same_as_other_ranks(lst: Sequence[int]) -> None:
    """Raise RuntimeError when this rank's list is not as long as rank 0's (collective: every rank calls it)."""
    (rank0_length,) = _broadcast_from_rank0([len(lst)])
    if rank0_length != len(lst):
        raise RuntimeError(
            f"list length differs between rank 0 and rank {_rank()}: rank 0 has {rank0_length}, "
            f"rank {_rank()} has {len(lst)}"
        )


def get_lst_from_rank0(lst: Sequence[int]) -> list[int]:
    """Rank 0's list of ints, on every rank (collective; every rank passes a list of the same length)."""
    return _broadcast_from_rank0(lst)


def assert_ints_same_as_other_ranks(ints: Sequence[int]) -> None:
    """Raise RuntimeError naming both lists when this rank's ints differ from rank 0's (collective).

    Costs two broadcasts and a synchronisation: for checks at setup, not per step.
    """
    assert_lst_len_same_as_other_ranks(ints)
    rank0_ints = get_lst_from_rank0(ints)
    if list(ints) != rank0_ints:
        raise RuntimeError(
            f"list contents differ between rank 0 and rank {_rank()} (length {len(ints)}): "
            f"rank 0 has {rank0_ints}, rank {_rank()} has {list(ints)}"
        )


def is_builtin_type(obj: object) -> bool:
    """Whether `obj`'s class is a Python builtin (int, str, None, ...)."""
    return type(obj).__module__ in ("builtins", "__builtin__")


def isinstance_namedtuple(obj: object) -> bool:
    """Whether `obj` is a `collections.namedtuple` / `typing.NamedTuple` instance."""
    return isinstance(obj, tuple) and hasattr(obj, "_asdict") and hasattr(obj, "_fields")


def is_zero_param(parameter: object) -> bool:
    """Whether `parameter` is a ZeRO-3 partitioned parameter (ds-zero's test; False without ds-zero)."""
    try:
        from ds_zero import is_zero_param as zero_test
    except ImportError:  # without ds-zero nothing is partitioned
        return False
    return torch.is_tensor(parameter) and bool(zero_test(parameter))


def apply_to_tensors_only(
    function: Callable[[torch.Tensor], torch.Tensor],
    value: Any,
    warning_msg_fn: Callable[[Any], str] | None = None,
) -> Any:
    """`value` with `function` applied to every tensor in it (through lists, tuples, namedtuples and dicts).

    Dicts are updated in place (so dict subclasses keep their type and identity); sequences are rebuilt with
    their own type. A tensor result that lost a ZeRO-3 parameter's identity gets `ds_param_alias` pointing
    back at it. Non-builtin leaves pass through unchanged; `warning_msg_fn(leaf)` is logged for the first.
    """
    warned = [False]

    def visit(item: Any) -> Any:
        if isinstance(item, (tuple, list)):
            touched = [visit(element) for element in item]
            return type(item)(*touched) if isinstance_namedtuple(item) else type(item)(touched)
        if isinstance(item, dict):
            for key in item:
                item[key] = visit(item[key])
            return item
        if isinstance(item, torch.Tensor):
            result = function(item)
            if is_zero_param(item) and not is_zero_param(result):
                setattr(result, "ds_param_alias", item)  # noqa: B010 - a tensor attribute torch does not declare
            return result
        if warning_msg_fn is not None and not warned[0] and not is_builtin_type(item) and _rank() == 0:
            logger.warning(warning_msg_fn(item))
            warned[0] = True
        return item

    return visit(value)


def get_mapping_to_flat_buffer(tensors: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, int, int]]:
    """(tensor, offset, numel) for each tensor laid end to end in one flat buffer, in order."""
    mapping = []
    offset = 0
    for tensor in tensors:
        mapping.append((tensor, offset, tensor.numel()))
        offset += tensor.numel()
    return mapping


def defragment(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Move `tensors` into one new contiguous buffer on their device; each becomes a view of it.

    The values pass through host memory and the device copies are freed first, so the device never holds
    old and new copies at once. All tensors must share one dtype and one device.
    """
    dtypes = {t.dtype for t in tensors}
    devices = {t.device for t in tensors}
    if len(dtypes) != 1 or len(devices) != 1:
        raise ValueError(
            f"defragment needs tensors of one dtype on one device, got dtypes {sorted(map(str, dtypes))} "
            f"and devices {sorted(map(str, devices))}"
        )
    mapping = get_mapping_to_flat_buffer(tensors)
    shapes = [tensor.shape for tensor in tensors]
    host = torch.empty(sum(numel for _, _, numel in mapping), dtype=dtypes.pop(), device="cpu")
    for tensor, offset, numel in mapping:
        host.narrow(0, offset, numel).copy_(tensor.reshape(-1))
        tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    gc.collect()
    get_accelerator().empty_cache()
    buffer = host.to(devices.pop())
    for (tensor, offset, numel), shape in zip(mapping, shapes, strict=True):
        tensor.data = buffer.narrow(0, offset, numel).view(shape)  # DeepSpeed leaves them flat; ds keeps shapes
    return buffer
