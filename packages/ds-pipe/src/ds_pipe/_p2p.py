"""Activations and gradients between neighbouring stages, with their shapes sent only when they change.

[Note: protocol] The first activation a stage sends (per mode, train or eval) is preceded by a
description: tuple-or-tensor, and per tensor dtype, requires_grad and shape, as one int64 tensor
(its length first). Later micro-batches send the data alone; the receiver allocates from the
cached description. A changed structure is then an error on the sender naming both shapes, unless
the module was built with `dynamic_shape=True`: every send then carries a one-element header (0:
same as before, n: a new n-long description follows), so descriptions still travel only when the
shape changes. Gradients need no description: the receiving stage knows its outputs' shapes.

Sends are non-blocking (`ds_comm.isend`); the tensors are kept until `finish_batch()`, which the
executor calls at the end of a batch. Neighbours on one host link through shared memory when the
stage is built (`ds_comm.open_shm_p2p`): messages up to its slot size then skip gloo's TCP, which
matters because two hops per micro-batch lie on 1F1B's critical path. Receives block, but with
static shapes the executor asks for the next message's receives to be posted early
(`prefetch_next`), so gloo lands the data during compute (not for messages the ring carries: see
[Note: no prefetch through the ring]). With tensor parallelism and `pipe_partitioned` /
`grad_partitioned`, each rank sends only its 1/mp slice of every floating tensor and the receiver
all-gathers the slices over its tensor-parallel group.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch.distributed import ProcessGroup

import ds_comm
from ds_pipe._grid import PipelineParallelGrid

logger = logging.getLogger(__name__)

_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
]
_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}

# (is_tuple, ((dtype, requires_grad, shape), ...))
Meta = tuple[bool, tuple[tuple[torch.dtype, bool, tuple[int, ...]], ...]]
# Posted receives of one message: (handle, buffer, full shape when the buffer is a tensor-parallel piece).
_Posted = list[tuple[ds_comm.CollectiveHandle, torch.Tensor, tuple[int, ...] | None]]


def as_tuple(value: Any) -> tuple[Any, ...]:
    """A stage input/output as a tuple (a single tensor becomes a 1-tuple)."""
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


class ActivationShapeError(ValueError):
    """A stage's output changed structure while the pipeline assumes static shapes."""


def describe(outputs: Any) -> Meta:
    """The structure of a stage's output: a tensor or a tuple of tensors.

    Raises:
        TypeError: the output holds something other than tensors, or an unsupported dtype.
    """
    is_tuple = isinstance(outputs, (tuple, list))
    tensors = tuple(outputs) if is_tuple else (outputs,)
    items = []
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"pipeline stages must pass tensors or tuples of tensors between them; element {i} of "
                f"the stage output is a {type(t).__name__}"
            )
        if t.dtype not in _CODE:
            raise TypeError(f"pipeline p2p cannot send dtype {t.dtype} (element {i} of the stage output)")
        items.append((t.dtype, t.requires_grad, tuple(t.shape)))
    return is_tuple, tuple(items)


def _encode(meta: Meta) -> list[int]:
    is_tuple, items = meta
    out = [int(is_tuple), len(items)]
    for dtype, requires_grad, shape in items:
        out += [_CODE[dtype], int(requires_grad), len(shape), *shape]
    return out


def _decode(values: list[int]) -> Meta:
    is_tuple, count, pos = bool(values[0]), values[1], 2
    items = []
    for _ in range(count):
        code, requires_grad, ndim = values[pos : pos + 3]
        shape = tuple(values[pos + 3 : pos + 3 + ndim])
        items.append((_DTYPES[code], bool(requires_grad), shape))
        pos += 3 + ndim
    return is_tuple, tuple(items)


class StageP2P:
    """Point-to-point traffic of one stage with its neighbours in the same pipeline.

    Args:
        grid: the grid (neighbours are `stage_to_global(stage ± 1)`, keeping data/model coordinates).
        device: where received tensors are allocated.
        dynamic_shape: allow output structure to change between micro-batches (see the module note).
        pipe_partitioned: send activation slices over the tensor-parallel group (only when it has > 1 rank).
        grad_partitioned: the same for gradients.
    """

    def __init__(
        self,
        grid: PipelineParallelGrid,
        device: torch.device,
        *,
        dynamic_shape: bool = False,
        pipe_partitioned: bool = True,
        grad_partitioned: bool = True,
    ) -> None:
        self.device = device
        self.dynamic_shape = dynamic_shape
        stage, num_stages = grid.get_stage_id(), grid.get_pipe_parallel_world_size()
        self.prev_rank = grid.stage_to_global(stage - 1) if stage > 0 else None
        self.next_rank = grid.stage_to_global(stage + 1) if stage < num_stages - 1 else None
        # Small sends between neighbours on one host go through shared memory (ds_comm._shm_p2p): every
        # stage links with its previous stage first, then its next, so the pairs' setups chain from stage 0.
        self.shared_memory = {
            peer: ds_comm.open_shm_p2p(peer) for peer in (self.prev_rank, self.next_rank) if peer is not None
        }
        slices = grid.get_slice_parallel_world_size()
        self._slice_group: ProcessGroup | None = grid.get_slice_parallel_group()
        self._slice_rank, self._slices = grid.get_slice_parallel_rank(), slices
        self.pipe_partitioned = pipe_partitioned and slices > 1
        self.grad_partitioned = grad_partitioned and slices > 1
        self.mode = "train"
        self._sent: dict[str, Meta] = {}
        self._received: dict[str, Meta] = {}
        self._pending: list[tuple[ds_comm.CollectiveHandle, torch.Tensor]] = []
        self._next_activation: _Posted | None = None
        self._next_grads: _Posted | None = None

    def reset_activation_shape(self) -> None:
        """Forget the exchanged descriptions; the next send/receive exchanges them again (all stages)."""
        self._sent.clear()
        self._received.clear()

    # Raw transfers
    def _isend(self, tensor: torch.Tensor, dst: int) -> None:
        if tensor.requires_grad:  # each call is a cold dispatch right after a stage's compute: skip no-ops
            tensor = tensor.detach()
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        self._pending.append((ds_comm.isend(tensor, dst), tensor))

    def _recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype, device=self.device)
        ds_comm.recv(tensor, src)
        return tensor

    def _post(self, specs: list[tuple[tuple[int, ...], torch.dtype]], src: int, partitioned: bool) -> _Posted:
        """Post the receives of one message (a stage output, or its gradients) without waiting."""
        posted: _Posted = []
        for shape, dtype in specs:
            if partitioned and dtype.is_floating_point:
                piece = torch.empty(math.ceil(math.prod(shape) / self._slices), dtype=dtype, device=self.device)
                posted.append((ds_comm.irecv(piece, src), piece, shape))
            else:
                tensor = torch.empty(shape, dtype=dtype, device=self.device)
                posted.append((ds_comm.irecv(tensor, src), tensor, None))
        return posted

    def _prefetches(self, specs: list[tuple[tuple[int, ...], torch.dtype]], src: int, partitioned: bool) -> bool:
        """Whether to post the next message's receives now: not when the shared-memory ring carries it.

        [Note: no prefetch through the ring] Posting early lets gloo land the data during compute; a ring
        message waits in its slot anyway. Posted early, the receives' cost (cold, right after the
        previous message arrived) lies between that arrival and the compute it feeds, on 1F1B's critical
        path; posted by the receive that waits for them, it hides in that wait.
        """
        if self.dynamic_shape:
            return False
        for shape, dtype in specs:
            numel = math.prod(shape)
            if partitioned and dtype.is_floating_point:
                numel = math.ceil(numel / self._slices)
            if not ds_comm.shm_p2p_carries(src, numel * dtype.itemsize):
                return True
        return False

    def _complete(self, posted: _Posted) -> list[torch.Tensor]:
        """Wait for posted receives; all-gather partitioned pieces over the tensor-parallel group."""
        out = []
        for handle, tensor, full_shape in posted:
            handle.wait()
            if full_shape is None:
                out.append(tensor)
                continue
            full = torch.empty(tensor.numel() * self._slices, dtype=tensor.dtype, device=self.device)
            ds_comm.all_gather_into_tensor(full, tensor, group=self._slice_group)
            out.append(full[: math.prod(full_shape)].view(full_shape))
        return out

    def wait_sends(self) -> None:
        """Wait for every outstanding send (their tensors may be freed afterwards)."""
        for handle, _ in self._pending:
            handle.wait()
        self._pending.clear()

    def _send_tensor(self, tensor: torch.Tensor, dst: int, partitioned: bool) -> None:
        if partitioned and tensor.is_floating_point():
            chunk = math.ceil(tensor.numel() / self._slices)
            flat = tensor.detach().reshape(-1)
            start = self._slice_rank * chunk
            piece = torch.zeros(chunk, dtype=flat.dtype, device=flat.device)
            mine = flat[start : start + chunk]
            piece[: mine.numel()] = mine
            tensor = piece
        self._isend(tensor, dst)

    # Activations
    def send_activations(self, outputs: Any) -> None:
        """Send a stage output (tensor or tuple of tensors) to the next stage."""
        assert self.next_rank is not None, "the last stage sends no activations"
        meta = describe(outputs)
        known = self._sent.get(self.mode)
        if meta != known:
            if known is not None and not self.dynamic_shape:
                raise ActivationShapeError(
                    f"stage output changed from {_show(known)} to {_show(meta)} between micro-batches; build the "
                    "PipelineModule with dynamic_shape=True, or call reset_activation_shape() on every stage "
                    "between batches"
                )
            encoded = _encode(meta)
            self._isend(torch.tensor([len(encoded)], dtype=torch.int64, device=self.device), self.next_rank)
            self._isend(torch.tensor(encoded, dtype=torch.int64, device=self.device), self.next_rank)
            self._sent[self.mode] = meta
        elif self.dynamic_shape:
            self._isend(torch.zeros(1, dtype=torch.int64, device=self.device), self.next_rank)
        for tensor in as_tuple(outputs):
            self._send_tensor(tensor, self.next_rank, self.pipe_partitioned)

    def recv_activations(self, prefetch_next: bool = False) -> Any:
        """Receive the previous stage's output; floating tensors that required grad there require it here.

        With `prefetch_next` (static shapes only) the receives of the next output are posted too, so
        gloo can land its data while this stage computes ([Note: no prefetch through the ring]).
        """
        assert self.prev_rank is not None, "the first stage receives no activations"
        posted, self._next_activation = self._next_activation, None
        meta = self._received.get(self.mode)
        if posted is None:
            if meta is None or self.dynamic_shape:
                length = int(self._recv((1,), torch.int64, self.prev_rank).item())
                if length:
                    meta = _decode(self._recv((length,), torch.int64, self.prev_rank).tolist())
                    self._received[self.mode] = meta
        assert meta is not None, "a dynamic-shape stream began without a description"
        specs = [(shape, dtype) for dtype, _, shape in meta[1]]
        if posted is None:
            posted = self._post(specs, self.prev_rank, self.pipe_partitioned)
        if prefetch_next and self._prefetches(specs, self.prev_rank, self.pipe_partitioned):
            self._next_activation = self._post(specs, self.prev_rank, self.pipe_partitioned)
        grad = torch.is_grad_enabled()
        tensors = [
            t.requires_grad_(requires_grad and grad)
            for t, (_, requires_grad, _) in zip(self._complete(posted), meta[1], strict=True)
        ]
        return tuple(tensors) if meta[0] else tensors[0]

    # Gradients
    def send_grads(self, inputs: Any) -> None:
        """Send the gradients of the received inputs that require grad (zeros where none arrived)."""
        assert self.prev_rank is not None, "the first stage sends no gradients"
        for tensor in as_tuple(inputs):
            if tensor.requires_grad:
                grad = tensor.grad if tensor.grad is not None else torch.zeros_like(tensor)
                self._send_tensor(grad, self.prev_rank, self.grad_partitioned)

    def recv_grads(self, outputs: Any, prefetch_next: bool = False) -> list[torch.Tensor]:
        """Receive the gradients of this stage's outputs that require grad, in order.

        With `prefetch_next` (static shapes only) the receives for the next micro-batch's gradients
        are posted too where gloo carries them (same shapes: static mode guarantees every output has
        the same structure).
        """
        assert self.next_rank is not None, "the last stage receives no gradients"
        specs = [(tuple(t.shape), t.dtype) for t in as_tuple(outputs) if t.requires_grad]
        posted, self._next_grads = self._next_grads, None
        if posted is None:
            posted = self._post(specs, self.next_rank, self.grad_partitioned)
        if prefetch_next and self._prefetches(specs, self.next_rank, self.grad_partitioned):
            self._next_grads = self._post(specs, self.next_rank, self.grad_partitioned)
        return self._complete(posted)

    def finish_batch(self) -> None:
        """Wait for outstanding sends; no prefetched receive may be left over."""
        assert self._next_activation is None and self._next_grads is None, "a prefetched receive was never used"
        self.wait_sends()


def _show(meta: Meta) -> str:
    shapes = [f"{str(dtype).replace('torch.', '')}{list(shape)}" for dtype, _, shape in meta[1]]
    return f"({', '.join(shapes)})" if meta[0] else shapes[0]
