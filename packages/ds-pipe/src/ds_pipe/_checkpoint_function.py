"""The reentrant activation-checkpoint autograd function and the ways it can store its saved inputs.

[Note: the dummy input] A reentrant checkpoint is an `autograd.Function`; its outputs require grad
only if one of its *inputs* does. The parameters used inside are not inputs, so a checkpointed
block fed raw data (the first stage of a pipeline) would silently get no gradients. Every call
passes an empty tensor that requires grad, so the backward always runs.

[Note: storing saved inputs] Three independent options, applied in this order:
partition (keep this rank's 1/mp slice of each floating input, all-gathered over the
tensor-parallel group before recomputation), cpu (move to host memory), contiguous (copy into a
flat buffer from a pool of reusable slots).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed import ProcessGroup

import ds_comm
from ds_comm import get_accelerator
from ds_pipe._rng import RngSnapshot

logger = logging.getLogger(__name__)

_Key = tuple[torch.dtype, torch.device]


class BufferPool:
    """`num_slots` reusable flat buffers (one per dtype/device each); a checkpoint holds one slot until backward."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._slots: list[dict[_Key, torch.Tensor]] = [{} for _ in range(num_slots)]
        self._free: list[int] = list(range(num_slots))
        self._warned = False

    def take(self, needs: dict[_Key, int]) -> tuple[int | None, dict[_Key, torch.Tensor]]:
        """A slot with at least `needs[key]` elements per key; slot None (fresh memory) when all are taken."""
        if not self._free:
            if not self._warned:
                logger.warning(
                    "more than number_checkpoints=%d checkpoints are alive at once; the extra ones use "
                    "fresh memory (raise number_checkpoints)",
                    self.num_slots,
                )
                self._warned = True
            return None, {key: torch.empty(n, dtype=key[0], device=key[1]) for key, n in needs.items()}
        slot = self._free.pop(0)
        buffers = self._slots[slot]
        for key, numel in needs.items():
            if key not in buffers or buffers[key].numel() < numel:
                buffers[key] = torch.empty(numel, dtype=key[0], device=key[1])
        return slot, buffers

    def release(self, slot: int | None) -> None:
        if slot is not None:
            self._free.append(slot)

    def clear(self) -> None:
        self._slots = [{} for _ in range(self.num_slots)]
        self._free = list(range(self.num_slots))


@dataclasses.dataclass(frozen=True)
class CheckpointPolicy:
    """How `checkpoint` stores its saved inputs (built by `checkpointing.configure`)."""

    partition_group: ProcessGroup | None = None
    partition_rank: int = 0
    partition_world: int = 1
    to_cpu: bool = False
    pool: BufferPool | None = None
    synchronize: bool = False
    profile: bool = False


#: Seconds spent per phase when profiling ("forward", "recompute", "backward") and the call count.
TIMINGS: dict[str, float] = defaultdict(float)


@dataclasses.dataclass(frozen=True)
class _Saved:
    """Where one positional argument went: a tensor slot (with how to rebuild it) or a plain object."""

    tensor_index: int | None
    obj: Any = None
    shape: torch.Size | None = None
    numel: int = 0
    device: torch.device | None = None
    requires_grad: bool = False
    partitioned: bool = False


def _pack(args: tuple[Any, ...], policy: CheckpointPolicy) -> tuple[list[_Saved], list[torch.Tensor], int | None]:
    layout: list[_Saved] = []
    data: list[torch.Tensor] = []
    for arg in args:
        if not isinstance(arg, torch.Tensor):
            layout.append(_Saved(tensor_index=None, obj=arg))
            continue
        tensor = arg.detach()
        partitioned = policy.partition_world > 1 and tensor.is_floating_point()
        if partitioned:
            chunk = math.ceil(tensor.numel() / policy.partition_world)
            flat = tensor.reshape(-1)
            padded = torch.zeros(chunk * policy.partition_world, dtype=flat.dtype, device=flat.device)
            padded[: flat.numel()] = flat
            tensor = padded[policy.partition_rank * chunk : (policy.partition_rank + 1) * chunk].clone()
        if policy.to_cpu and tensor.device.type != "cpu":
            tensor = tensor.to("cpu")
        layout.append(
            _Saved(
                tensor_index=len(data),
                shape=arg.shape,
                numel=arg.numel(),
                device=arg.device,
                requires_grad=arg.requires_grad,
                partitioned=partitioned,
            )
        )
        data.append(tensor)
    slot = None
    if policy.pool is not None and data:
        needs: dict[_Key, int] = defaultdict(int)
        for t in data:
            needs[(t.dtype, t.device)] += t.numel()
        slot, buffers = policy.pool.take(dict(needs))
        offsets: dict[_Key, int] = defaultdict(int)
        for i, t in enumerate(data):
            key = (t.dtype, t.device)
            view = buffers[key][offsets[key] : offsets[key] + t.numel()].view(t.shape)
            view.copy_(t)
            offsets[key] += t.numel()
            data[i] = view
    return layout, data, slot


def _unpack(layout: list[_Saved], data: tuple[torch.Tensor, ...], policy: CheckpointPolicy) -> list[Any]:
    args: list[Any] = []
    for item in layout:
        if item.tensor_index is None:
            args.append(item.obj)
            continue
        tensor = data[item.tensor_index]
        if tensor.device != item.device:
            tensor = tensor.to(item.device)
        if item.partitioned:
            full = torch.empty(tensor.numel() * policy.partition_world, dtype=tensor.dtype, device=tensor.device)
            ds_comm.all_gather_into_tensor(full, tensor.contiguous(), group=policy.partition_group)
            tensor = full[: item.numel]
        tensor = tensor.detach().view(item.shape)
        tensor.requires_grad_(item.requires_grad)
        args.append(tensor)
    return args


def _autocast_state() -> list[tuple[str, bool, torch.dtype]]:
    types = {"cpu", get_accelerator().device().type}
    return [(t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in sorted(types)]


def _sync(policy: CheckpointPolicy) -> None:
    if policy.synchronize:
        get_accelerator().synchronize()


class CheckpointFunction(torch.autograd.Function):
    """Run `run_function` without keeping its activations; rerun it (same RNG draws) in backward."""

    @staticmethod
    def forward(
        ctx: Any, run_function: Callable[..., Any], policy: CheckpointPolicy, dummy: torch.Tensor, *args: Any
    ) -> Any:
        del dummy  # only there to make the outputs require grad (module note)
        _sync(policy)
        start = time.perf_counter()
        ctx.run_function = run_function
        ctx.policy = policy
        ctx.rng = RngSnapshot.capture()
        ctx.autocast = _autocast_state()
        with torch.no_grad():
            outputs = run_function(*args)
        if isinstance(outputs, list):
            outputs = tuple(outputs)
        if not isinstance(outputs, (torch.Tensor, tuple)):
            raise TypeError(f"checkpoint: the function must return a tensor or a tuple, got {type(outputs).__name__}")
        ctx.layout, data, ctx.slot = _pack(args, policy)
        ctx.save_for_backward(*data)
        flat = (outputs,) if isinstance(outputs, torch.Tensor) else outputs
        ctx.mark_non_differentiable(*[o for o in flat if isinstance(o, torch.Tensor) and not o.is_floating_point()])
        _sync(policy)
        if policy.profile:
            TIMINGS["forward"] += time.perf_counter() - start
            TIMINGS["calls"] += 1
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(
                "checkpoint() does not work with torch.autograd.grad(); use .backward() or non_reentrant_checkpoint()"
            )
        policy: CheckpointPolicy = ctx.policy
        _sync(policy)
        start = time.perf_counter()
        inputs = _unpack(ctx.layout, ctx.saved_tensors, policy)
        now = RngSnapshot.capture()
        ctx.rng.restore()
        try:
            with torch.enable_grad(), _autocast_contexts(ctx.autocast):
                outputs = ctx.run_function(*inputs)
        finally:
            now.restore()
        recomputed = time.perf_counter()
        flat = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
        pairs = [
            (o, g)
            for o, g in zip(flat, grads, strict=True)
            if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
        ]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if policy.pool is not None:
            policy.pool.release(ctx.slot)
        _sync(policy)
        if policy.profile:
            TIMINGS["recompute"] += recomputed - start
            TIMINGS["backward"] += time.perf_counter() - recomputed
        input_grads = tuple(x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None for x in inputs)
        return (None, None, None, *input_grads)


class _autocast_contexts:  # noqa: N801 - used like a function in a `with`
    """Re-enter the autocast state captured at forward time (for every device type involved)."""

    def __init__(self, states: list[tuple[str, bool, torch.dtype]]) -> None:
        self._contexts = [torch.autocast(device_type=t, enabled=on, dtype=dtype) for t, on, dtype in states]

    def __enter__(self) -> None:
        for c in self._contexts:
            c.__enter__()

    def __exit__(self, *exc: object) -> None:
        for c in reversed(self._contexts):
            c.__exit__(*exc)
