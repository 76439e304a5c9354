"""`TrainState`: what a checkpoint records about training, as a value; and the one model-states dict built from it.

The engines capture a `TrainState` at save time (their own fields, read by themselves), and the
checkpoint writer turns it into DeepSpeed's model-states dict here, in one place for the plain
and the pipeline engine. Loading goes the other way through `restored_counters` and the RNG
helpers, again shared by both engines.
"""

from __future__ import annotations

import dataclasses
import random
import sys
from typing import Any

import torch

from ds_engine.__about__ import __version__

__all__ = [
    "ENGINE_KEYS",
    "Counters",
    "TrainState",
    "curriculum_sampler",
    "curriculum_sampler_state",
    "model_states",
    "restored_counters",
    "rng_state",
    "set_rng_state",
]

#: Keys of the model-states file the engine restores itself; everything else is returned as client_state.
ENGINE_KEYS = (
    "module",
    "optimizer",
    "lr_scheduler",
    "skipped_steps",
    "global_steps",
    "micro_steps",
    "rng_states",
    "data_sampler",
    "random_ltd",
    "optimizer_param_states",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Counters:
    """The engine's step counters (DeepSpeed's names)."""

    global_steps: int
    """Optimizer-step boundaries taken (applied or skipped)."""
    global_samples: int
    """Samples consumed: global_steps x train_batch_size, unless the batch size changed on the way."""
    micro_steps: int
    """`step()` calls (micro-batches)."""
    skipped_steps: int
    """Boundaries whose update was skipped (fp16/bf16 overflow)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainState:
    """Everything the model-states file holds besides the user's client_state, captured at save time."""

    module: dict[str, Any] | None
    """The module's state_dict; None for a pipeline (its weights go to per-layer files)."""
    buffer_names: list[str]
    """Names of the module's buffers (DeepSpeed's key, read by zero_to_fp32)."""
    optimizer: dict[str, Any] | None
    """The stage-0 stepper's state (loss scaler, fp32 masters); None under ZeRO (per-rank partition files)."""
    param_shapes: list[dict[str, torch.Size]] | None
    """Per param group, name -> shape of the trainable parameters (ZeRO only, as DeepSpeed writes it)."""
    shared_params: dict[str, str] | None = None
    """Tied parameters, alias -> the name holding the values (ZeRO only; DeepSpeed's `shared_params`)."""
    frozen_param_shapes: dict[str, torch.Size] | None = None
    """Name -> shape of the parameters no ZeRO partition holds (ZeRO 2/3, as DeepSpeed writes it)."""
    frozen_param_fragments: dict[str, torch.Tensor] | None = None
    """Name -> value of those parameters (`ds_zero`'s model-states note: the whole parameter in ds's layout)."""
    lr_scheduler: dict[str, Any] | None
    """The lr scheduler's state_dict, if there is a scheduler."""
    counters: Counters
    dp_world_size: int
    mp_world_size: int
    pp_degree: int = 1
    """Pipeline stages (1 for the plain engine)."""
    tp_degree: int = 1
    """Tensor-parallel degree."""
    sp_degree: int = 1
    """Sequence-parallel degree. ZeRO partitions over data x sequence ranks, so `dp_world_size` (the
    partition count, as DeepSpeed records it) is replicas x `sp_degree`; a load re-partitions onto any split."""
    ds_config: dict[str, Any]
    """The config as the user wrote it."""
    rng_states: list[dict[str, Any]]
    """Every rank's RNG state, in global rank order."""
    data_sampler: dict[str, Any] | None = None
    """The curriculum sampler's state (DeepSpeed's `data_sampler` key), under curriculum learning."""
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Engine-specific keys (the pipeline's stage layout)."""
    random_ltd: dict[str, Any] | None = None
    """The random-LTD scheduler's state_dict, when random-LTD is enabled."""


def model_states(state: TrainState, client_state: dict[str, Any], *, ds_version: str = __version__) -> dict[str, Any]:
    """DeepSpeed's model-states dict for `state`, plus the user's `client_state` (`ds_version`: the writer's
    version, ds's by default).

    Raises:
        ValueError: a `client_state` key collides with a key the engine writes (it is never overwritten).
    """
    c = state.counters
    out: dict[str, Any] = {
        "module": state.module,
        "buffer_names": state.buffer_names,
        "optimizer": state.optimizer,
        "param_shapes": state.param_shapes,
        "frozen_param_shapes": state.frozen_param_shapes,
        "shared_params": state.shared_params,
        "frozen_param_fragments": state.frozen_param_fragments,
        "lr_scheduler": state.lr_scheduler,
        "data_sampler": state.data_sampler,
        "random_ltd": state.random_ltd,
        "skipped_steps": c.skipped_steps,
        "global_steps": c.global_steps,
        "global_samples": c.global_samples,
        "micro_steps": c.micro_steps,
        "dp_world_size": state.dp_world_size,
        "mp_world_size": state.mp_world_size,
        # DeepSpeed writes pp and tp here; ds adds sp (DeepSpeed's readers take the keys they know).
        "checkpoint_parallel_dimensions": {
            "pp_degree": state.pp_degree,
            "tp_degree": state.tp_degree,
            "sp_degree": state.sp_degree,
        },
        "ds_config": state.ds_config,
        "ds_version": ds_version,
        **({"rng_states": state.rng_states} if state.rng_states else {}),
        **state.extra,
    }
    clash = sorted(set(client_state) & set(out))
    if clash:
        raise ValueError(f"client_state keys {clash} collide with keys the engine writes; rename them")
    out.update(client_state)
    return out


def restored_counters(saved: dict[str, Any], *, train_batch_size: int, gradient_accumulation_steps: int) -> Counters:
    """The counters in a loaded model-states dict; keys older writers lack are derived from global_steps.

    A saved `micro_steps` that is not a multiple of this run's `gradient_accumulation_steps` (saved at
    another world size, hence another accumulation count) would put the accumulation boundary mid-batch:
    it is derived from global_steps then, as for DeepSpeed's files, which have none.
    """
    global_steps = int(saved["global_steps"])
    micro_steps = int(saved.get("micro_steps", global_steps * gradient_accumulation_steps))
    if micro_steps % gradient_accumulation_steps:
        micro_steps = global_steps * gradient_accumulation_steps
    return Counters(
        global_steps=global_steps,
        global_samples=int(saved.get("global_samples", global_steps * train_batch_size)),
        micro_steps=micro_steps,
        skipped_steps=int(saved.get("skipped_steps", 0)),
    )


def rng_state() -> dict[str, Any]:
    """This process's RNG states: Python, torch CPU, CUDA (when initialised), numpy (when imported)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` captured (the parts this process has)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    numpy = sys.modules.get("numpy")
    if "numpy" in state and numpy is not None:
        numpy.random.set_state(state["numpy"])


def curriculum_sampler(engine: Any) -> Any:
    """The training loader's curriculum sampler, when curriculum learning drives it (an engine without a
    training loader or data efficiency, such as a bare `CheckpointedEngine`, has none)."""
    loader = getattr(engine, "training_dataloader", None)
    enabled = getattr(engine, "curriculum_learning_enabled", None)
    if loader is None or enabled is None or not enabled():
        return None
    return loader.data_sampler


def curriculum_sampler_state(engine: Any) -> dict[str, Any] | None:
    """The curriculum sampler's state to save, when there is one."""
    sampler = curriculum_sampler(engine)
    return sampler.state_dict() if sampler is not None else None
