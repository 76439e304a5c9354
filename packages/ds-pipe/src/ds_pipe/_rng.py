"""RNG state capture and named RNG streams, so a recomputed forward draws the same dropout masks.

[Note: which generators] A forward pass can draw from the CPU generator and from the accelerator's
generator of the current device (on a CPU-only host they are the same one), and, under tensor
parallelism, from named streams kept by `CudaRNGStatesTracker` (e.g. `model-parallel-rng`, seeded
differently on each tensor-parallel rank so dropout inside a sharded layer differs per shard).
`RngSnapshot` captures all of them; restoring it before recomputation replays the same masks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator

import torch

from ds_comm import get_accelerator

logger = logging.getLogger(__name__)

__all__ = ["CudaRNGStatesTracker", "RngSnapshot", "get_cuda_rng_tracker", "model_parallel_cuda_manual_seed"]

#: Name of the tensor-parallel stream that `model_parallel_cuda_manual_seed` creates (DeepSpeed's name).
MODEL_PARALLEL_RNG = "model-parallel-rng"


def _device() -> torch.device:
    return get_accelerator().device()


def get_device_rng_state() -> torch.Tensor:
    """The generator state of the accelerator's current device (the CPU generator on CPU)."""
    device = _device()
    if device.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device.type).get_rng_state(device)


def set_device_rng_state(state: torch.Tensor) -> None:
    """Restore a state from `get_device_rng_state`."""
    device = _device()
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(device.type).set_rng_state(state, device)


class CudaRNGStatesTracker:
    """Named RNG streams on the accelerator's generator (the name is DeepSpeed's; any device works).

    `add(name, seed)` creates a stream; `with tracker.fork(name):` draws from it, leaving the default
    stream untouched, and advances the named one.
    """

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def reset(self) -> None:
        """Forget every stream."""
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of the streams' states (name -> generator state)."""
        return {name: state.clone() for name, state in self.states_.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace the streams' states (e.g. with a snapshot from `get_states`)."""
        self.states_ = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        """Create stream `name` seeded with `seed`.

        Raises:
            ValueError: the name or the seed is already in use (two streams must never coincide).
        """
        if seed in self.seeds_:
            raise ValueError(f"CudaRNGStatesTracker.add: seed {seed} is already used by another stream")
        if name in self.states_:
            raise ValueError(f"CudaRNGStatesTracker.add: stream {name!r} already exists")
        self.seeds_.add(seed)
        saved = get_device_rng_state()
        try:
            device = _device()
            if device.type == "cpu":
                torch.manual_seed(seed)
            else:
                torch.get_device_module(device.type).manual_seed(seed)
            self.states_[name] = get_device_rng_state()
        finally:
            set_device_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw from stream `name` inside the block; the default stream is restored afterwards.

        Raises:
            KeyError: no stream of that name was added.
        """
        if name not in self.states_:
            raise KeyError(
                f"CudaRNGStatesTracker.fork: no stream {name!r}; add it first (known: {sorted(self.states_)})"
            )
        saved = get_device_rng_state()
        set_device_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = get_device_rng_state()
            set_device_rng_state(saved)


_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """The process-wide tracker that `checkpoint` snapshots and restores."""
    return _TRACKER


def model_parallel_cuda_manual_seed(seed: int, tensor_parallel_rank: int = 0) -> None:
    """Seed the default stream with `seed` and the tensor-parallel stream with `seed + 2718 + tp_rank`.

    The default stream is identical across tensor-parallel ranks (dropout outside sharded layers
    must agree); the `model-parallel-rng` stream differs per rank.
    """
    device = _device()
    if device.type == "cpu":
        torch.manual_seed(seed)
    else:
        torch.get_device_module(device.type).manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + 2718 + tensor_parallel_rank)


@dataclasses.dataclass(frozen=True)
class RngSnapshot:
    """Every generator a forward pass may draw from (see the module note)."""

    cpu: torch.Tensor
    device: torch.Tensor | None
    tracker: dict[str, torch.Tensor]

    @classmethod
    def capture(cls) -> RngSnapshot:
        device = None if _device().type == "cpu" else get_device_rng_state()
        return cls(cpu=torch.get_rng_state(), device=device, tracker=_TRACKER.get_states())

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.device is not None:
            set_device_rng_state(self.device)
        _TRACKER.set_states(self.tracker)
