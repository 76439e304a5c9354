"""FusedAdam: Adam / AdamW over all parameters of a group at once, on CUDA tensors or CPU tensors.

CUDA tensors step with the fused_adam CUDA op (one launch per dtype); CPU tensors with the fused_adam
op of a CPU accelerator, which is ds-ops' CPU Adam kernel (`CPUFusedAdamBuilder`), as DeepSpeed's CPU
accelerator gives FusedAdam its CPU Adam kernel.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ds_ops._cpu_optimizer import DTYPE_CODES, KernelBatch, check_non_negative, check_unit_interval
from ds_ops.adam._scalars import adam_scalars
from ds_ops.op_builder import CPUFusedAdamBuilder, FusedAdamBuilder, OpBuildError, OpNotCompatibleError

logger = logging.getLogger(__name__)

# Elements one CUDA block updates; also the granularity of the tensor lookup.
CHUNK_NUMEL = 65536

_DEVICE_TYPES = ("cuda", "cpu")


class FusedAdam(torch.optim.Optimizer):
    """Adam / AdamW over all parameters of a group in one kernel call per device (DeepSpeed's FusedAdam).

    CUDA parameters: one launch per (device, dtype) gets a device table of every tensor's addresses
    and sizes; each CUDA block updates one chunk of `CHUNK_NUMEL` elements. CPU parameters: one call
    of the CPU Adam kernel per group spreads every tensor's tiles over `torch.get_num_threads()`
    OpenMP threads. Either way math is fp32 in torch.optim.Adam's order, without fused multiply-adds;
    moments have the parameter's dtype (fp32, bf16 or fp16), as in DeepSpeed. Each device's op is
    loaded (built on first use) when a parameter on that device joins.

    [Note: FusedAdam's step count] The count is per parameter (`state["step"]`, an int), as in
    DeepSpeed's FusedAdam, whose comment gives the reason: ZeRO-3 steps one sub-group at a time (the
    group narrowed to one tile), so a per-group count would advance once per tile. Parameters of one
    group at different counts take one kernel call per count. A new state starts from
    `group.get("step", 0)`: that is how a state saved without a count (by ds's FusedAdam before it
    kept one per parameter, with the count under `group["step"]`) resumes at the right step, as
    DeepSpeed's does. States of `DeepSpeedCPUAdam` and of torch's Adam/AdamW (same keys, a per-
    parameter step) load as they are; moments are cast to the parameter's dtype by torch's loader.

    Args:
        params: parameters or param groups (CUDA or CPU tensors).
        lr: learning rate (default 1e-3).
        bias_correction: divide the moments by (1 - beta^t) (default True).
        betas: (beta1, beta2) (default (0.9, 0.999)).
        eps: added to the denominator (default 1e-8).
        adam_w_mode: decoupled weight decay (AdamW) when True, else L2 added to the gradient (default True).
        weight_decay: default 0.
        amsgrad: not supported; True raises.
        set_grad_none: `zero_grad()` sets gradients to None (default True).

    Raises:
        OpNotCompatibleError: a parameter is on CUDA and this host cannot run the CUDA op (the
            message says why), or an op cannot be built.
        OpBuildError: the compiler failed on an op (its output is in the message).
        ValueError: amsgrad=True, a hyper-parameter out of range, or a parameter neither on CUDA nor the CPU.
        TypeError: a parameter's dtype is not fp32/bf16/fp16.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        if amsgrad:
            raise ValueError("FusedAdam: amsgrad=True is not supported; use amsgrad=False")
        self.adam_w_mode = adam_w_mode
        self.set_grad_none = set_grad_none
        self._kernels: dict[str, Callable[..., int]] = {}  # by device type, loaded by add_param_group
        defaults = {
            "lr": lr,
            "bias_correction": bias_correction,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
        }
        super().__init__(params, defaults)

    def _load_kernel(self, device_type: str) -> None:
        if device_type in self._kernels:
            return
        if device_type == "cpu":
            self._kernels["cpu"] = CPUFusedAdamBuilder().load().ds_cpu_adam_step
            return
        builder = FusedAdamBuilder()
        problems = builder.runtime_problems()
        if problems:
            raise OpNotCompatibleError(
                f"FusedAdam needs a CUDA device for CUDA parameters: {'; '.join(problems)}. Keep the "
                "parameters on the CPU (FusedAdam steps CPU tensors too) or use torch.optim.AdamW"
            )
        self._kernels["cuda"] = builder.load().ds_fused_adam_step

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's `add_param_group`, then checks (CUDA or CPU tensors of fp32/bf16/fp16, valid
        hyper-parameters) and the op of each device the group uses; on failure the group is not added."""
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        group = self.param_groups[index]
        owner = f"FusedAdam param_groups[{index}]"
        try:
            for i, param in enumerate(group["params"]):
                if param.device.type not in _DEVICE_TYPES:
                    raise ValueError(
                        f"{owner}['params'][{i}] is on {param.device}; FusedAdam updates CUDA or CPU tensors"
                    )
                if param.dtype not in DTYPE_CODES and param.requires_grad:  # a frozen one is never stepped
                    raise TypeError(f"{owner}['params'][{i}] has dtype {param.dtype}; use float32, bfloat16 or float16")
            for key in ("lr", "eps", "weight_decay"):
                check_non_negative(owner, key, group[key])
            check_unit_interval(owner, "betas[0]", group["betas"][0])
            check_unit_interval(owner, "betas[1]", group["betas"][1])
            for device_type in sorted({param.device.type for param in group["params"]}):
                self._load_kernel(device_type)
        except (TypeError, ValueError, OpNotCompatibleError, OpBuildError):
            self.param_groups.pop()
            raise

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's `load_state_dict`; a saved group without one of FusedAdam's hyper-parameters (torch's
        Adam/AdamW have no `bias_correction`) gets this optimizer's default for it. Only FusedAdam's own
        hyper-parameters are filled in: torch's loader adds `differentiable` to `defaults`, which this
        optimizer does not have, and a reloaded group must keep the keys of the one that was saved."""
        own_defaults = dict(self.defaults)
        super().load_state_dict(state_dict)
        self.defaults = own_defaults
        for group in self.param_groups:
            for key, value in own_defaults.items():
                group.setdefault(key, value)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients: to None when `set_grad_none` (DeepSpeed's behaviour), else as torch does."""
        super().zero_grad(set_to_none=self.set_grad_none or set_to_none)

    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], Any] | None = None,
        grads: Any = None,
        output_params: Any = None,
        scale: Any = None,
        grad_norms: Any = None,
        grad_scaler: Any = None,
    ) -> Any:
        """One Adam step for every parameter with a gradient: per group, one CUDA launch per (device,
        dtype, step count) and one CPU kernel call per step count for its CPU tensors (one of each
        when the group's parameters are stepped together, the usual case).

        The legacy arguments (grads, output_params, scale, grad_norms, grad_scaler) are rejected, as
        in DeepSpeed.
        """
        if any(arg is not None for arg in (grads, output_params, scale, grad_norms, grad_scaler)):
            raise ValueError(
                "FusedAdam.step takes only `closure`: the legacy grads/output_params/scale/"
                "grad_norms/grad_scaler arguments were removed (as in DeepSpeed)"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            buckets: dict[tuple[torch.device, torch.dtype, int], list[tuple[torch.Tensor, ...]]] = {}
            hosts: dict[int, KernelBatch] = {}
            counts: list[tuple[dict[str, Any], int]] = []  # written once every parameter passed the checks
            for i, param in enumerate(group["params"]):
                if param.grad is None or param.numel() == 0:
                    continue
                if param.grad.is_sparse:
                    raise TypeError(f"FusedAdam param_groups[{index}]['params'][{i}] has a sparse gradient")
                if param.grad.dtype != param.dtype:
                    raise TypeError(
                        f"FusedAdam param_groups[{index}]['params'][{i}]: gradient dtype "
                        f"{param.grad.dtype} differs from the parameter's {param.dtype}"
                    )
                state = self.state[param]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros(param.shape, dtype=param.dtype, device=param.device)
                    state["exp_avg_sq"] = torch.zeros(param.shape, dtype=param.dtype, device=param.device)
                step = int(state.get("step", group.get("step", 0))) + 1
                counts.append((state, step))
                if param.device.type == "cpu":
                    for key in ("exp_avg", "exp_avg_sq"):
                        if not state[key].is_contiguous():
                            state[key] = state[key].contiguous()
                    batch = hosts.setdefault(step, KernelBatch())
                    batch.add(param, param.grad.contiguous(), [state["exp_avg"], state["exp_avg_sq"]], None)
                else:
                    buckets.setdefault((param.device, param.dtype, step), []).append(
                        (param, param.grad, state["exp_avg"], state["exp_avg_sq"])
                    )
            for state, step in counts:
                state["step"] = step
            for step, batch in hosts.items():
                self._step_cpu(batch, group, step)
            for (device, dtype, step), tensors in buckets.items():
                self._launch(device, dtype, tensors, group, step)
        return loss

    def _step_cpu(self, batch: KernelBatch, group: dict[str, Any], step: int) -> None:
        scalars = adam_scalars(group, step, self.adam_w_mode)
        status = self._kernels["cpu"](*batch.arrays(), *scalars, torch.get_num_threads())
        assert status == 0, f"ds_cpu_adam_step returned {status}: arguments were checked before the call"
        batch.write_back()

    def _launch(
        self,
        device: torch.device,
        dtype: torch.dtype,
        tensors: list[tuple[torch.Tensor, ...]],
        group: dict[str, Any],
        step: int,
    ) -> None:
        # Non-contiguous tensors are updated through contiguous copies written back afterwards (same stream).
        work = [tuple(t if t.is_contiguous() else t.contiguous() for t in item) for item in tensors]
        chunks = [(item[0].numel() + CHUNK_NUMEL - 1) // CHUNK_NUMEL for item in work]
        offsets = [0]
        for count in chunks:
            offsets.append(offsets[-1] + count)
        table = [value for item in work for value in (*(t.data_ptr() for t in item), item[0].numel())]
        meta = torch.tensor(table + offsets, dtype=torch.int64).pin_memory().to(device, non_blocking=True)
        with torch.cuda.device(device):
            stream = torch.cuda.current_stream(device).cuda_stream
            status = self._kernels["cuda"](
                meta.data_ptr(),
                len(work),
                offsets[-1],
                CHUNK_NUMEL,
                DTYPE_CODES[dtype],
                *adam_scalars(group, step, self.adam_w_mode),
                stream,
            )
        if status != 0:
            raise RuntimeError(f"FusedAdam kernel launch failed with CUDA error {status} on {device}")
        for original, used in zip(tensors, work, strict=True):
            for position, (dst, src) in enumerate(zip(original, used, strict=True)):
                if position != 1 and dst is not src:  # position 1 is the gradient: read only
                    dst.copy_(src)
