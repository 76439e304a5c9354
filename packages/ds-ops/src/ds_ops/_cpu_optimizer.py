"""What DeepSpeedCPUAdam, DeepSpeedCPUAdagrad and DeepSpeedCPULion share.

Parameter and hyper-parameter checks (before any work), optimizer state in fp32 or in the
parameter's dtype, the in-pass bf16/fp16 copy targets (`fp16_param_groups`), and a state_dict load
that keeps the state dtype (torch's `Optimizer.load_state_dict` casts floating state to the
parameter's dtype, which would round fp32 moments of a bf16 parameter).
"""

from __future__ import annotations

import ctypes
import logging
import math
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch

from ds_ops.host_memory import huge_page_zeros
from ds_ops.op_builder import OpBuilder

logger = logging.getLogger(__name__)

DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

CopyTargets = torch.Tensor | list[torch.Tensor | None] | list[list[torch.Tensor | None]] | None


def dtype_code(tensor: torch.Tensor) -> int:
    """The kernels' code for `tensor`'s dtype (0 fp32, 1 bf16, 2 fp16)."""
    return DTYPE_CODES[tensor.dtype]


class KernelBatch:
    """The tensors of one kernel call, as the C side takes them: per-tensor arrays of sizes,
    pointers and dtype codes. A non-contiguous parameter is updated through a contiguous copy that
    `write_back()` copies into it after the call."""

    def __init__(self) -> None:
        self.numels: list[int] = []
        self.params: list[int] = []
        self.param_dtypes: list[int] = []
        self.grads: list[int] = []
        self.grad_dtypes: list[int] = []
        self.states: list[list[int]] = []
        self.state_dtypes: list[int] = []
        self.copies: list[int | None] = []
        self.copy_dtypes: list[int] = []
        self._alive: list[torch.Tensor] = []  # tensors whose memory the call uses
        self._write_back: list[tuple[torch.Tensor, torch.Tensor]] = []

    def add(
        self, param: torch.Tensor, grad: torch.Tensor, states: list[torch.Tensor], copy: torch.Tensor | None
    ) -> None:
        data = param.data
        if not param.is_contiguous():
            data = data.contiguous()
            self._write_back.append((param, data))
        self._alive += [data, grad]
        self.numels.append(data.numel())
        self.params.append(data.data_ptr())
        self.param_dtypes.append(dtype_code(data))
        self.grads.append(grad.data_ptr())
        self.grad_dtypes.append(dtype_code(grad))
        for index, state in enumerate(states):
            if len(self.states) <= index:
                self.states.append([])
            self.states[index].append(state.data_ptr())
        self.state_dtypes.append(dtype_code(states[0]))
        self.copies.append(None if copy is None else copy.data_ptr())
        self.copy_dtypes.append(0 if copy is None else dtype_code(copy))

    def arrays(self) -> tuple[Any, ...]:
        """(num_tensors, numels, params, param dtypes, grads, grad dtypes, *states, state dtypes, copies,
        copy dtypes): the leading arguments of every CPU optimizer kernel."""
        n = len(self.numels)
        pointers = ctypes.c_void_p * n
        codes = ctypes.c_int32 * n
        copies = pointers(*self.copies) if any(c is not None for c in self.copies) else None
        return (
            n,
            (ctypes.c_int64 * n)(*self.numels),
            pointers(*self.params),
            codes(*self.param_dtypes),
            pointers(*self.grads),
            codes(*self.grad_dtypes),
            *(pointers(*s) for s in self.states),
            codes(*self.state_dtypes),
            copies,
            codes(*self.copy_dtypes),
        )

    def write_back(self) -> None:
        for param, data in self._write_back:
            param.data.copy_(data)


def check_unit_interval(owner: str, name: str, value: float) -> None:
    """Raise ValueError unless 0 <= value < 1 (a beta)."""
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{owner}: {name}={value!r} must be in [0, 1)")


def check_non_negative(owner: str, name: str, value: float) -> None:
    """Raise ValueError unless value >= 0 (lr, eps, weight_decay)."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0.0):
        raise ValueError(f"{owner}: {name}={value!r} must be a finite number >= 0")


class CPUOptimizerBase(torch.optim.Optimizer):
    """A torch optimizer whose step runs a ds-ops CPU kernel once per parameter.

    Subclasses set `STATE_KEYS`, `KERNEL` (the C function's name), `SUPPORTS_SPARSE`, and implement
    `_check_group` and `_call_kernel`. Every one declares the in-pass copy (`IN_PASS_COPY`, see
    `ds_ops.supports_in_pass_copy`): `step(fp16_param_groups=...)`.
    """

    IN_PASS_COPY: ClassVar[bool] = True
    STATE_KEYS: ClassVar[tuple[str, ...]] = ()
    KERNEL: ClassVar[str] = ""
    SUPPORTS_SPARSE: ClassVar[bool] = False

    def __init__(
        self, model_params: Iterable[Any], defaults: dict[str, Any], *, fp32_optimizer_states: bool, builder: OpBuilder
    ) -> None:
        self.fp32_optimizer_states = fp32_optimizer_states
        super().__init__(model_params, defaults)
        # Built (or loaded from cache) at construction, as DeepSpeed does: a compiler problem shows
        # here, not at the first step.
        self._library: ctypes.CDLL = builder.load()
        self._kernel: Callable[..., int] = getattr(self._library, self.KERNEL)

    # ---- checks ---------------------------------------------------------------------------------
    @property
    def _owner(self) -> str:
        return type(self).__name__

    def _check_group(self, group: dict[str, Any], where: str) -> None:
        raise NotImplementedError

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's `add_param_group`, then the checks: CPU tensors of fp32/bf16/fp16, valid hyper-parameters.

        Raises:
            ValueError: a parameter is not on the CPU, or a hyper-parameter is out of range; the group
                is not added.
            TypeError: a parameter's dtype is not float32, bfloat16 or float16.
        """
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        group = self.param_groups[index]
        try:
            for i, param in enumerate(group["params"]):
                where = f"param_groups[{index}]['params'][{i}]"
                if param.device.type != "cpu":
                    raise ValueError(
                        f"{self._owner}: {where} is on {param.device}; it updates CPU tensors only. Keep the "
                        "parameters on the CPU (with ZeRO: 'offload_optimizer': {'device': 'cpu'}), or use "
                        "FusedAdam / a torch.optim optimizer for accelerator tensors"
                    )
                if param.dtype not in DTYPE_CODES and param.requires_grad:  # a frozen one is never stepped
                    raise TypeError(
                        f"{self._owner}: {where} has dtype {param.dtype}; supported dtypes are "
                        "torch.float32, torch.bfloat16 and torch.float16"
                    )
            self._check_group(group, f"param_groups[{index}]")
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise

    def _copy_targets(self, fp16_param_groups: CopyTargets) -> list[list[torch.Tensor | None]] | None:
        """`fp16_param_groups` in DeepSpeed's accepted forms, as one list per group, checked in full."""
        if fp16_param_groups is None:
            return None
        if torch.is_tensor(fp16_param_groups):
            groups: list[Any] = [[fp16_param_groups]]
        elif isinstance(fp16_param_groups, (list, tuple)) and not any(
            isinstance(item, (list, tuple)) for item in fp16_param_groups
        ):
            groups = [list(fp16_param_groups)]
        else:
            groups = [list(group) for group in fp16_param_groups]  # type: ignore[union-attr]
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"{self._owner}.step: fp16_param_groups has {len(groups)} group(s), the optimizer has "
                f"{len(self.param_groups)}; pass one list of copy targets per param group"
            )
        for g, (targets, group) in enumerate(zip(groups, self.param_groups, strict=True)):
            if len(targets) != len(group["params"]):
                raise ValueError(
                    f"{self._owner}.step: fp16_param_groups[{g}] has {len(targets)} tensor(s), "
                    f"param group {g} has {len(group['params'])}; pass one target (or None) per parameter"
                )
            for i, (target, param) in enumerate(zip(targets, group["params"], strict=True)):
                if target is None:
                    continue
                where = f"fp16_param_groups[{g}][{i}]"
                if not torch.is_tensor(target) or target.device.type != "cpu" or not target.is_contiguous():
                    raise ValueError(f"{self._owner}.step: {where} must be a contiguous CPU tensor")
                if target.dtype not in DTYPE_CODES:
                    raise TypeError(
                        f"{self._owner}.step: {where} has dtype {target.dtype}; use torch.bfloat16, "
                        "torch.float16 or torch.float32"
                    )
                if target.numel() != param.numel():
                    raise ValueError(
                        f"{self._owner}.step: {where} has {target.numel()} elements, its parameter has {param.numel()}"
                    )
        return groups

    # ---- the step -------------------------------------------------------------------------------
    def _state_dtype(self, param: torch.Tensor) -> torch.dtype:
        return torch.float32 if self.fp32_optimizer_states else param.dtype

    def _new_state_tensor(self, param: torch.Tensor) -> torch.Tensor:
        """Zeros shaped like `param` in the state dtype; in huge pages when large (each step streams
        the state end to end, see ds_ops.host_memory)."""
        return huge_page_zeros(param.numel(), self._state_dtype(param)).view(param.shape)

    def _init_state(self, param: torch.Tensor, state: dict[str, Any]) -> None:
        state["step"] = 0
        for key in self.STATE_KEYS:
            state[key] = self._new_state_tensor(param)

    def _grad(self, param: torch.Tensor, where: str) -> torch.Tensor:
        grad = param.grad
        assert grad is not None
        if grad.is_sparse:
            if not self.SUPPORTS_SPARSE:
                raise TypeError(f"{self._owner}: {where} has a sparse gradient, which it does not support")
            grad = grad.to_dense()
        if grad.dtype not in DTYPE_CODES:
            raise TypeError(
                f"{self._owner}: the gradient of {where} has dtype {grad.dtype}; supported dtypes "
                "are torch.float32, torch.bfloat16 and torch.float16"
            )
        return grad.contiguous()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, fp16_param_groups: CopyTargets = None) -> Any:
        """Update every parameter that has a gradient; optionally copy the results into bf16/fp16 tensors.

        One kernel call per param group (per distinct step count within it) updates all its
        tensors, their tiles spread over `torch.get_num_threads()` threads in one OpenMP region.

        Args:
            closure: re-evaluates the model and returns the loss (run with grad enabled).
            fp16_param_groups: copy targets written in the same pass as the update (what ZeRO-Offload
                needs to avoid a second pass): one list per param group with one tensor (or None) per
                parameter, a single list (one group), or a single tensor (one parameter). Each target is
                a contiguous CPU tensor of the parameter's numel, in bf16, fp16 or fp32; it receives
                the updated parameter rounded to its dtype (nearest even, as `Tensor.to` does).

        Returns:
            The closure's loss, or None.

        Raises:
            ValueError, TypeError: a copy target does not fit (checked before any parameter changes).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        copies = self._copy_targets(fp16_param_groups)
        num_threads = torch.get_num_threads()
        for g, group in enumerate(self.param_groups):
            batches: dict[int, KernelBatch] = {}
            for i, param in enumerate(group["params"]):
                if param.grad is None:
                    continue
                grad = self._grad(param, f"param_groups[{g}]['params'][{i}]")
                state = self.state[param]
                if not state:
                    self._init_state(param, state)
                state["step"] += 1
                if param.numel() == 0:
                    continue
                for key in self.STATE_KEYS:
                    if not state[key].is_contiguous():
                        state[key] = state[key].contiguous()
                batch = batches.setdefault(state["step"], KernelBatch())
                batch.add(param, grad, [state[key] for key in self.STATE_KEYS], copies[g][i] if copies else None)
            for step, batch in batches.items():
                status = self._call_kernel(batch, group, step, num_threads)
                assert status == 0, f"{self.KERNEL} returned {status}: arguments were checked before the call"
                batch.write_back()
        return loss

    def _call_kernel(self, batch: KernelBatch, group: dict[str, Any], step: int, num_threads: int) -> int:
        raise NotImplementedError

    # ---- checkpoints ----------------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's `load_state_dict`, keeping optimizer state in its own dtype (fp32 by default).

        Accepts a state_dict of the same optimizer class, or of torch's optimizer with the same
        state keys (a tensor `step` becomes an int).
        """
        saved_state = state_dict["state"]
        saved_ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
        own = [param for group in self.param_groups for param in group["params"]]
        # checked before anything is replaced (a count mismatch is left to torch's own check)
        for pid, param in zip(saved_ids, own, strict=False):
            saved = saved_state.get(pid) or {}
            missing = [key for key in ("step", *self.STATE_KEYS) if saved and key not in saved]
            if missing:
                raise ValueError(
                    f"{self._owner}.load_state_dict: the state of parameter {pid} has no {missing}; "
                    f"it was saved by another optimizer (keys: {sorted(saved_state[pid])})"
                )
            for key in self.STATE_KEYS:
                if key in saved and saved[key].numel() != param.numel():
                    raise ValueError(
                        f"{self._owner}.load_state_dict: the state of parameter {pid} has {key} of "
                        f"{saved[key].numel()} elements, the parameter has {param.numel()}; the "
                        "state_dict was saved for another model"
                    )
        super().load_state_dict(state_dict)  # keeps our parameter objects: `own` still lists them
        for pid, param in zip(saved_ids, own, strict=True):
            saved = saved_state.get(pid)
            if not saved:
                continue
            state = self.state[param]
            state["step"] = int(saved["step"])
            for key in self.STATE_KEYS:
                state[key] = self._new_state_tensor(param).copy_(saved[key].reshape(param.shape))
