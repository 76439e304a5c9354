"""Activation checkpointing (`deepspeed.checkpointing`): recompute a block's forward in backward, same dropout.

    from ds_pipe import checkpointing
    checkpointing.configure(None, deepspeed_config={"activation_checkpointing": {"cpu_checkpointing": True}})
    y = checkpointing.checkpoint(block, x)          # activations inside `block` are not kept

`checkpoint` is reentrant (an autograd Function) and snapshots every generator the forward may
draw from (CPU, the accelerator's, and the named streams of `get_cuda_rng_tracker()`), restoring
them for the recomputation, so dropout masks are reproduced exactly and the gradients are
bit-identical to running without checkpointing. `configure` reads the `activation_checkpointing`
section (see `ActivationCheckpointingConfig`); explicit arguments override it.

DeepSpeed keeps that configuration in module globals, and code written for it reads them:
`PARTITION_ACTIVATIONS`, `CONTIGUOUS_CHECKPOINTING`, `num_layers`, `CPU_CHECKPOINT`, `SYNCHRONIZE`,
`PROFILE_TIME`, `mpu` and `deepspeed_checkpointing_enabled` read the current configuration here
(defaults before `configure`). They are views: assigning one changes nothing, `configure` does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.utils.checkpoint as torch_checkpoint

import ds_comm
from ds_pipe._checkpoint_function import TIMINGS, BufferPool, CheckpointFunction, CheckpointPolicy
from ds_pipe._rng import CudaRNGStatesTracker, get_cuda_rng_tracker, model_parallel_cuda_manual_seed

if TYPE_CHECKING:
    from ds_pipe.config import ActivationCheckpointingConfig

logger = logging.getLogger(__name__)

__all__ = [
    "ActivationCheckpointingConfig",
    "CudaRNGStatesTracker",
    "checkpoint",
    "configure",
    "get_cuda_rng_tracker",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "model_parallel_reconfigure_tp_seed",
    "non_reentrant_checkpoint",
    "partition_activations_in_checkpoint",
    "reset",
    "set_num_layers",
    "timings",
]


@dataclasses.dataclass
class _State:
    configured: bool = False
    config: ActivationCheckpointingConfig | None = None  # None: the section's defaults
    mpu: Any = None
    policy: CheckpointPolicy = dataclasses.field(default_factory=CheckpointPolicy)


_state = _State()


def _model() -> type[ActivationCheckpointingConfig]:
    """The section's model, imported on first use (pydantic costs ~0.3 s at import; see ds_comm)."""
    from ds_pipe.config import ActivationCheckpointingConfig

    return ActivationCheckpointingConfig


def _config() -> ActivationCheckpointingConfig:
    """The configuration in force: the last `configure`'s, else the section's defaults."""
    return _state.config if _state.config is not None else _model()()


# DeepSpeed's module globals (see the module docstring), each computed from the configuration in force.
_DEEPSPEED_GLOBALS: dict[str, Callable[[], object]] = {
    "PARTITION_ACTIVATIONS": lambda: _config().partition_activations,
    "CONTIGUOUS_CHECKPOINTING": lambda: _config().contiguous_memory_optimization,
    "num_layers": lambda: _config().number_checkpoints,
    "CPU_CHECKPOINT": lambda: _config().cpu_checkpointing,
    "SYNCHRONIZE": lambda: _config().synchronize_checkpoint_boundary,
    "PROFILE_TIME": lambda: _config().profile,
    "mpu": lambda: _state.mpu,
    "deepspeed_checkpointing_enabled": lambda: _state.configured,
}


def __getattr__(name: str) -> object:
    if name == "ActivationCheckpointingConfig":
        return _model()
    if name in _DEEPSPEED_GLOBALS:
        return _DEEPSPEED_GLOBALS[name]()
    raise AttributeError(f"module 'ds_pipe.checkpointing' has no attribute {name!r}")


def _section(deepspeed_config: Any) -> ActivationCheckpointingConfig:
    """The section from a model, a section dict, a whole ds_config dict, a JSON path, or an object with it."""
    ActivationCheckpointingConfig = _model()  # noqa: N806 - the class, loaded lazily
    if deepspeed_config is None:
        return ActivationCheckpointingConfig()
    if isinstance(deepspeed_config, ActivationCheckpointingConfig):
        return deepspeed_config
    if isinstance(deepspeed_config, (str, os.PathLike)):
        with open(deepspeed_config, encoding="utf-8") as f:
            deepspeed_config = json.load(f)
    if isinstance(deepspeed_config, Mapping):
        if "activation_checkpointing" in deepspeed_config:
            section = deepspeed_config["activation_checkpointing"]
        elif not deepspeed_config or set(deepspeed_config) & set(ActivationCheckpointingConfig.valid_keys()):
            section = deepspeed_config  # the section itself (a typo among its keys is reported)
        else:
            return ActivationCheckpointingConfig()  # a whole ds_config without the section
        return ds_comm.validate_section(ActivationCheckpointingConfig, section, path="activation_checkpointing")
    section = getattr(deepspeed_config, "activation_checkpointing", None)
    if section is None:
        raise TypeError(
            "configure: deepspeed_config must be an ActivationCheckpointingConfig, a dict, a path to a "
            f"JSON file, or an object with an activation_checkpointing attribute; got {deepspeed_config!r}"
        )
    return _section(section)


def _tensor_parallel(mpu: Any) -> tuple[Any, int, int]:
    """(group, rank, world) of the tensor-parallel group: the slice group of a grid, else the mpu's model group."""
    if mpu is None:
        return None, 0, 1
    if hasattr(mpu, "get_slice_parallel_group"):
        return mpu.get_slice_parallel_group(), mpu.get_slice_parallel_rank(), mpu.get_slice_parallel_world_size()
    return mpu.get_model_parallel_group(), mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size()


def _build_policy(config: ActivationCheckpointingConfig, mpu: Any) -> CheckpointPolicy:
    group, rank, world = _tensor_parallel(mpu)
    if config.partition_activations and world == 1:
        warnings.warn(
            "activation_checkpointing.partition_activations has no effect without tensor parallelism "
            "(pass mpu_ with a model-parallel group of more than one rank)",
            stacklevel=3,
        )
    partition_world = world if config.partition_activations else 1
    pool = None
    if config.contiguous_memory_optimization:
        assert config.number_checkpoints is not None  # the config model requires it
        pool = BufferPool(config.number_checkpoints)
    return CheckpointPolicy(
        partition_group=group,
        partition_rank=rank,
        partition_world=partition_world,
        to_cpu=config.cpu_checkpointing,
        pool=pool,
        synchronize=config.synchronize_checkpoint_boundary,
        profile=config.profile,
    )


def configure(
    mpu_: Any = None,
    deepspeed_config: Any = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """Set how `checkpoint` stores its inputs, from the `activation_checkpointing` section and overrides.

    Args:
        mpu_: the model-parallel unit: a `PipelineParallelGrid` (its slice group is used) or a
            Megatron-style mpu (`get_model_parallel_group/rank/world_size`); None without tensor parallelism.
        deepspeed_config: an `ActivationCheckpointingConfig`, the section as a dict, a whole ds_config
            dict, a path to a JSON ds_config, or an object with an `activation_checkpointing` attribute.
        partition_activations: overrides `partition_activations`.
        contiguous_checkpointing: overrides `contiguous_memory_optimization`.
        num_checkpoints: overrides `number_checkpoints`.
        checkpoint_in_cpu: overrides `cpu_checkpointing`.
        synchronize: overrides `synchronize_checkpoint_boundary`.
        profile: overrides `profile`.

    Raises:
        ConfigError: the section is invalid (unknown key, contiguous without a checkpoint count, ...); an
            AssertionError too, as DeepSpeed's checks are. The configuration in force is left as it was.
    """
    base = _section(deepspeed_config)
    overrides = {
        key: value
        for key, value in {
            "partition_activations": partition_activations,
            "contiguous_memory_optimization": contiguous_checkpointing,
            "number_checkpoints": num_checkpoints,
            "cpu_checkpointing": checkpoint_in_cpu,
            "synchronize_checkpoint_boundary": synchronize,
            "profile": profile,
        }.items()
        if value is not None
    }
    merged = ds_comm.validate_section(_model(), {**base.model_dump(), **overrides}, path="activation_checkpointing")
    _state.config, _state.mpu, _state.configured = merged, mpu_, True
    _state.policy = _build_policy(merged, mpu_)
    logger.debug("activation checkpointing configured: %s", merged)


def is_configured() -> bool:
    """Whether `configure` has been called (since the last `reset`)."""
    return _state.configured


def reset() -> None:
    """Back to the defaults: no partitioning, offload or buffers; timings cleared."""
    if _state.policy.pool is not None:
        _state.policy.pool.clear()
    _state.configured, _state.config, _state.mpu = False, None, None
    _state.policy = CheckpointPolicy()
    TIMINGS.clear()


def set_num_layers(nlayers: int) -> None:
    """Set `number_checkpoints` (the buffer count of `contiguous_memory_optimization`)."""
    configure(_state.mpu, _state.config, num_checkpoints=nlayers)


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    """Turn `partition_activations` on or off, keeping the rest of the configuration."""
    configure(_state.mpu, _state.config, partition_activations=partition_activation)


def timings() -> dict[str, float]:
    """Seconds in checkpointed forward / recompute / backward and the call count (with `profile`)."""
    return dict(TIMINGS)


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run `function(*args, **kwargs)` keeping only its inputs; recompute it during backward.

    Tensors among `args` get gradients; keyword arguments are passed through as constants. Returns
    what `function` returns (a tensor or a tuple; a list becomes a tuple). Under `torch.no_grad()`
    it simply calls `function`. Issues an all-gather on the tensor-parallel group in backward when
    `partition_activations` is on.
    """
    if kwargs:
        function = functools.partial(function, **kwargs)
    if not torch.is_grad_enabled():
        return function(*args)
    dummy = torch.empty(0, requires_grad=True)
    # torch.autograd.Function.apply carries no annotations.
    return CheckpointFunction.apply(function, _state.policy, dummy, *args)  # type: ignore[no-untyped-call]


@contextlib.contextmanager
def _tracker_states(states: dict[str, torch.Tensor]) -> Iterator[None]:
    tracker = get_cuda_rng_tracker()
    saved = tracker.get_states()
    tracker.set_states(states)
    try:
        yield
    finally:
        tracker.set_states(saved)


def non_reentrant_checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """Checkpoint through torch's non-reentrant implementation (works with `torch.autograd.grad`).

    The CPU and device generators are preserved by torch; the tracker's named streams are restored
    here. The storage options of `configure` (partition, cpu, contiguous) do not apply.
    """

    def context_fn() -> tuple[contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]]:
        return contextlib.nullcontext(), _tracker_states(get_cuda_rng_tracker().get_states())

    return torch_checkpoint.checkpoint(
        function, *args, use_reentrant=False, preserve_rng_state=True, context_fn=context_fn
    )


def model_parallel_reconfigure_tp_seed(seed: int) -> None:
    """Re-seed the tensor-parallel stream with `seed + 2718 + tp_rank` (tp_rank from the configured mpu)."""
    _, rank, _ = _tensor_parallel(_state.mpu)
    tracker = get_cuda_rng_tracker()
    states = tracker.get_states()
    tracker.reset()
    for name, state in states.items():
        if name != "model-parallel-rng":
            tracker.states_[name] = state
    tracker.add("model-parallel-rng", seed + 2718 + rank)
