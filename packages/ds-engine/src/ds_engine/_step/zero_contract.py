"""The ZeRO <-> engine contract as types: what ds-engine calls on ds-zero, and nothing more.

ds-zero's `DeepSpeedZeroOptimizer` (stages 1/2) and `DeepSpeedZeroOptimizer_Stage3` satisfy these
Protocols structurally: ds-zero never imports ds-engine (it sits below it in the DAG), and ds-engine
imports ds-zero only lazily (the `zero` extra), so the contract lives here, on the side that relies
on it. `tests/test_zero_contract.py` checks both ds-zero classes against it.

What crosses the seam:
  * construction, one calling convention for every stage (`ZeroOptimizerFactory`);
  * the step path: `backward`, `step(skip=...) -> applied`, `zero_grad`, and what the engine reports
    (`loss_scale`, `global_grad_norm`); `param_groups` is what `engine.get_lr()` reads;
  * `offload_states` / `reload_states` / `offloaded_states` / `empty_partition_cache` (RLHF: states
    parked in host memory between steps) and `state_devices` (where each kind of state is now);
  * `coalesce_grad_reduction()` (the engine's context of that name: one reduction for several backwards);
  * checkpoints: `state_dict` (this rank's partition), `load_state_dict` (all saved ranks, any world
    size), `refresh_fp32_params` (masters from just-loaded module weights); and module-level
    functions of `ds_zero`: `zero_param_shapes(optimizer, module)` (the model-states file's
    `param_shapes`), `shared_param_names(module)` and `frozen_fields(...)` (its `shared_params` and
    frozen-parameter fields), `load_partition_state_dicts(ckpt_dir, mp_rank=)` (every saved rank's
    partition, ds's or DeepSpeed's files), `consolidate_fp32_params(state_dicts)`, `read_frozen_params`
    and `with_shared` (full weights, for DeepSpeed's stage-3 placeholders) and
    `copy_recovery_scripts(save_dir)` (`zero_to_fp32.py` and `zero_to_torch.py`);
  * per-parameter access for `deepspeed.utils.safe_get_full_fp32_param` and friends: the
    `ZeroParamAccess` methods (DeepSpeed's stage-3 optimizer names, at every stage) and
    `ds_zero.zero_optimizer_of(param)`, the optimizer that trains a parameter (None for none).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from ds_ops import OffloadDeviceEnum, OffloadStateTypeEnum
from ds_ops.precision import LossScaler

__all__ = ["ZeroOptimizer", "ZeroOptimizerFactory", "ZeroParamAccess"]


@runtime_checkable
class ZeroOptimizer(Protocol):
    """A ZeRO optimizer as the engine drives it (`ZeroStepper`)."""

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The base optimizer's groups (lr schedulers write `lr` here)."""
        ...

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without fp16 scaling)."""
        ...

    @property
    def global_grad_norm(self) -> float | None:
        """The unscaled global norm at the last step, before clipping; None when not computed."""
        ...

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """`(loss * loss_scale).backward()`; the engine has already divided by the accumulation steps."""
        ...

    def step(self, closure: Any = None, *, skip: torch.Tensor | None = None) -> bool:
        """The boundary step on every rank (a collective); False when it was skipped.

        `skip` is a 1-element flag already agreed across every rank that must skip together (the
        pipeline's stages): non-zero skips the step as an overflow does, loss-scale update included.
        """
        ...

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every accumulated gradient (the engine calls it after each boundary step)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """THIS rank's partition in ds-zero's checkpoint format."""
        ...

    def load_state_dict(
        self,
        state_dicts: list[Mapping[str, Any]] | Mapping[str, Any],
        load_optimizer_states: bool = True,
        load_from_fp32_weights: bool = True,
    ) -> None:
        """Restore from ALL saved ranks' state dicts (rank order); a collective."""
        ...

    def refresh_fp32_params(self) -> None:
        """Reset the fp32 masters from the module's current (just loaded) weights."""
        ...

    @property
    def offloaded_states(self) -> set[OffloadStateTypeEnum]:
        """The kinds of state `offload_states` moved off and `reload_states` has not brought back."""
        ...

    def offload_states(
        self,
        include: Container[OffloadStateTypeEnum] | None = None,
        device: OffloadDeviceEnum = OffloadDeviceEnum.cpu,
        pin_memory: bool = True,
        non_blocking: bool = False,
    ) -> None:
        """Move this rank's states to host memory (`engine.offload_states()`); not a collective."""
        ...

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring back, bit for bit, what `offload_states` moved."""
        ...

    def empty_partition_cache(self) -> None:
        """Stage 3: free the gathered parameters no running module holds; otherwise nothing."""
        ...

    def coalesce_grad_reduction(self) -> AbstractContextManager[None]:
        """A block whose backwards keep their gradients on the parameters; its exit reduces them in one pass."""
        ...

    def state_devices(self, state: OffloadStateTypeEnum | str) -> set[torch.device]:
        """The devices the bytes of one kind of state are on now (`get_state_devices`)."""
        ...


@runtime_checkable
class ZeroParamAccess(Protocol):
    """One parameter's fp32 master, gradient and optimizer state, as `deepspeed.utils.tensor_fragment` reads them.

    The `full` methods work on the parameter's whole value and are collectives over the data-parallel
    group; the `local` ones on this rank's partition (ZeRO-3; stages 1/2 raise ValueError). Getters give
    None, and setters do nothing, for a parameter the optimizer does not train. `optim_state_key` None
    means the fp32 master itself.
    """

    def get_full_hp_param(self, param: torch.Tensor, optim_state_key: str | None = None) -> torch.Tensor | None: ...

    def set_full_hp_param(
        self, value: torch.Tensor, param: torch.Tensor, optim_state_key: str | None = None
    ) -> None: ...

    def get_fp32_grad_for_param(self, param: torch.Tensor) -> torch.Tensor | None: ...

    def set_fp32_grad_for_param(self, value: torch.Tensor, param: torch.Tensor) -> None: ...

    def update_fp32_grad_for_param_vectorized(
        self, update_func: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], param_list: list[torch.Tensor]
    ) -> None: ...

    def get_local_fp32_param(self, param: torch.Tensor, optim_state_key: str | None = None) -> torch.Tensor | None: ...

    def set_local_hp_param(
        self, value: torch.Tensor, param: torch.Tensor, optim_state_key: str | None = None
    ) -> None: ...

    def get_local_fp32_grad_for_param(self, param: torch.Tensor) -> torch.Tensor | None: ...

    def set_local_grad_for_param(self, value: torch.Tensor, param: torch.Tensor) -> None: ...


class ZeroOptimizerFactory(Protocol):
    """How `initialize()` builds a ZeRO optimizer, the same for every stage (`_zero_wiring.build_zero_optimizer`).

    Stage 3 also takes `aio_config=` (the top-level `aio` section) when it swaps to NVMe; stages 1/2 take
    `model_parallel_group=` and `model_parallel_params=` with tensor parallelism, and `gradient_average=`
    (False for `gradient_allreduce_op: "sum"`).
    """

    def __call__(
        self,
        optimizer: Optimizer,
        *,
        config: Any,
        module: nn.Module | None,
        loss_scaler: LossScaler,
        clip_grad: float,
        check_overflow: bool,
        dp_group: ProcessGroup | None,
        gradient_predivide_factor: float,
        communication_dtype: torch.dtype | None,
        **kwargs: Any,
    ) -> ZeroOptimizer: ...
