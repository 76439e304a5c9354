"""fp16/bf16 training at ZeRO stage 0: fp32 master weights, loss scaling, overflow skip, fp32 accumulation.

[Note: the step] The base optimizer steps fp32 master copies of the 16-bit parameters (its
param groups are re-pointed at them once). Gradients accumulate either in an fp32 flat buffer
(bf16 default: after each backward the 16-bit grads are added in and freed) or in a 16-bit flat
buffer bound to the parameters (fp16 default, as DeepSpeed does), copied to fp32 at the boundary.
At the boundary: all-reduce the accumulation buffer, then `ds_ops.precision.finish_step` over the
whole fp32 buffer (unscale, inf/nan check, scaler update, norm, clip; identical on every rank after
the all-reduce, so `partitioned=False`: no extra collective; with tensor parallelism one over the
tensor-parallel group), and either skip (zero the grads) or
step the masters and copy them back into the 16-bit parameters.

An MoE model's buffers hold the dense gradients first, then each expert group's: the dense part is
all-reduced over the data-parallel group, each expert part over its expert-data-parallel group (divided
by the data-parallel world, as `_moe.MoeFp32Stepper` does), and the norm and overflow flag are combined
over the expert-parallel group as tensor parallelism's are (experts are the parameters each rank of it
holds differently).
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed import ProcessGroup
from torch.optim import Optimizer
from torch.utils.weak import WeakIdKeyDictionary

from ds_engine._plan.reduce_settings import ReduceSettings
from ds_engine._report.timers import NullTimers, WallClockTimers
from ds_engine._step.data_parallel import FlatGradBuffer, GradAllReducer
from ds_engine._step.moe import is_expert_param
from ds_ops.precision import LossScaler, WrappedOptimizer, finish_step

if TYPE_CHECKING:
    from ds_engine._step.moe import MoeWiring

logger = logging.getLogger(__name__)

_UC_INFO = "universal_checkpoint_info"  # the parameter attribute (and state-dict key) DeepSpeed's clients set

__all__ = ["MixedPrecisionOptimizer", "stage0_grad_owner"]

# parameter -> weak reference to the MixedPrecisionOptimizer holding its accumulated gradient (by identity)
_grad_owners = WeakIdKeyDictionary()


def stage0_grad_owner(param: torch.Tensor) -> MixedPrecisionOptimizer | None:
    """The live fp16/bf16 stage-0 optimizer that accumulates `param`'s gradient, or None."""
    ref = _grad_owners.get(param)
    return None if ref is None else ref()


class MixedPrecisionOptimizer(WrappedOptimizer):
    """The optimizer `initialize()` returns for fp16/bf16 at stage 0 (DeepSpeed's FP16_Optimizer role).

    Args:
        optimizer: the base optimizer, built over the (already 16-bit) model parameters; its param
            groups are re-pointed at fp32 master copies here.
        dtype: the parameters' dtype (`torch.float16` or `torch.bfloat16`).
        loss_scaler: a `ds_ops.precision` scaler (dynamic for fp16 by default, static 1.0 for bf16).
        grad_accum_dtype: `torch.float32`, or `dtype` to accumulate in the parameters' own `.grad`.
        immediate_grad_update: with fp32 accumulation, add each 16-bit gradient into the fp32 buffer from a
            post-accumulate-grad hook, as soon as backward has produced it, and free it there (DeepSpeed's
            `bf16.immediate_grad_update`): the 16-bit gradients never all exist at once. The sums are the
            same as moving them after the backward.
        clip_grad: `gradient_clipping` (0: off).
        check_overflow: skip steps whose gradients hold inf/nan (always for fp16; `bf16.check_grad_overflow`).
        reduce: data-parallel settings, or None on one rank.
        group: the data-parallel process group.
        world_size: its size.
        timers: times the all-reduce.
        model_parallel_group: the tensor-parallel group (None: none); the norm and the overflow flag span it.
        moe: an MoE model's expert groups (see the module note); not with `model_parallel_group`.

    Raises:
        ValueError: `moe` with tensor parallelism, or with experts in more than one expert-parallel size.
        model_parallel_params: the model parameters cut across it; the others are counted once in the norm.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        dtype: torch.dtype,
        loss_scaler: LossScaler,
        grad_accum_dtype: torch.dtype,
        clip_grad: float,
        immediate_grad_update: bool = False,
        check_overflow: bool,
        reduce: ReduceSettings | None,
        group: Any,
        world_size: int,
        timers: WallClockTimers | NullTimers,
        model_parallel_group: ProcessGroup | None = None,
        model_parallel_params: Sequence[torch.Tensor] = (),
        moe: MoeWiring | None = None,
    ) -> None:
        if moe is not None and model_parallel_group is not None:
            raise ValueError("fp16/bf16 at ZeRO stage 0: MoE layers with tensor parallelism are not supported")
        if moe is not None and len(moe.ep_groups) > 1:
            raise ValueError(
                f"fp16/bf16 at ZeRO stage 0: MoE layers of different expert-parallel sizes "
                f"({', '.join(sorted(moe.ep_groups))}) need ZeRO stage 1 or 2 (zero_optimization.stage)"
            )
        self.optimizer = optimizer
        self.dtype = dtype
        self.loss_scaler = loss_scaler
        self.clip_grad = clip_grad
        self.check_overflow = check_overflow
        self.timers = timers
        self.overflow = False
        self._global_grad_norm = None
        self._reduced = False
        self.model_params: list[torch.Tensor] = []
        self.masters: list[torch.Tensor] = []
        #: DeepSpeed's name: each param group's 16-bit model parameters.
        self.bf16_groups: list[list[torch.Tensor]] = []
        self._make_masters()
        self._enable_universal_checkpoint()
        trainable = [i for i, p in enumerate(self.model_params) if p.requires_grad]
        if moe is not None:  # dense gradients first, then the experts': each part is reduced over its own group
            trainable.sort(key=lambda i: is_expert_param(self.model_params[i]))
        self._train_model = [self.model_params[i] for i in trainable]
        self._train_masters = [self.masters[i] for i in trainable]
        self._train_index = {id(p): i for i, p in enumerate(self._train_model)}
        owner = weakref.ref(self)
        for p in self._train_model:
            _grad_owners[p] = owner
        self.master_grads = FlatGradBuffer(self._train_masters, torch.float32, bind=True)
        if grad_accum_dtype == torch.float32:
            self.accum = self.master_grads
            self._absorb_into = self.master_grads.views
        else:
            self.accum = FlatGradBuffer(self._train_model, dtype, bind=True, lazy_bind=True)
            self._absorb_into = None
        self._hooks = self._absorb_during_backward() if immediate_grad_update and self._absorb_into is not None else []
        self.reducers: list[GradAllReducer] = []
        num_dense = len(self._train_model)
        if moe is not None:
            num_dense = sum(not is_expert_param(p) for p in self._train_model)
            # One expert group (checked above): its parameters are the ones each expert-parallel rank holds.
            model_parallel_group = next(iter(moe.ep_groups.values()), None)
            model_parallel_params = self._train_model[num_dense:]
        if reduce is not None:
            if num_dense:
                self.reducers.append(
                    GradAllReducer(self.accum, reduce, group=group, world_size=world_size, stop=num_dense)
                )
            if moe is not None and num_dense < len(self._train_model):
                (edp,) = moe.edp_groups.values()
                self.reducers.append(
                    GradAllReducer(self.accum, reduce, group=edp, world_size=world_size, first=num_dense)
                )
        self.model_parallel_group = model_parallel_group
        self._cut_grads = None
        if model_parallel_group is not None:
            cut = {id(p) for p in model_parallel_params}
            masters = [m for p, m in zip(self._train_model, self._train_masters, strict=True) if id(p) in cut]
            self._cut_grads = self.master_grads.views_of(masters)

    def _make_masters(self) -> None:
        remap: dict[int, torch.Tensor] = {}
        for group in self.optimizer.param_groups:
            masters = []
            for p in group["params"]:
                if p.dtype != self.dtype:
                    raise TypeError(
                        f"MixedPrecisionOptimizer: a parameter of dtype {p.dtype} is in the optimizer; "
                        f"all parameters must be {self.dtype} (the engine casts them)"
                    )
                master = torch.nn.Parameter(p.detach().to(torch.float32).clone(), requires_grad=p.requires_grad)
                remap[id(p)] = master
                self.model_params.append(p)
                self.masters.append(master)
                masters.append(master)
            self.bf16_groups.append(list(group["params"]))
            group["params"] = masters
        for p in list(self.optimizer.state):
            if id(p) in remap:
                self.optimizer.state[remap[id(p)]] = self.optimizer.state.pop(p)

    def _enable_universal_checkpoint(self) -> None:
        """Cache the first `universal_checkpoint_info` a model parameter carries (DeepSpeed's Megatron-style
        clients set it on parameters), so it is read once here and not looked up at save time."""
        self._universal_checkpoint_info = next(
            (info for group in self.bf16_groups for p in group if (info := getattr(p, _UC_INFO, None)) is not None),
            None,
        )

    def _get_universal_checkpoint_info(self) -> dict[str, Any] | None:
        """The cached `universal_checkpoint_info` (None when no parameter carried one)."""
        return getattr(self, "_universal_checkpoint_info", None)

    # -- the optimizer face (param_groups, state, defaults, loss_scale, ...: `WrappedOptimizer`) -----------
    @property
    def fp32_groups_gradients_flat(self) -> list[torch.Tensor]:
        """DeepSpeed's name: each param group's fp32 gradients as one flat tensor, its trained parameters in order.

        Views of the fp32 gradient buffer (a copy only where an MoE model's expert-last order splits a group).
        With fp32 accumulation (bf16's default) they hold the window's sums, reduced over the data-parallel
        ranks once the boundary backward has run; with 16-bit accumulation the step fills them.
        """
        flat, out = self.master_grads.flat, []
        for group in self.optimizer.param_groups:
            views = [v.reshape(-1) for v in self.master_grads.views_of(group["params"])]
            adjacent = all(b.storage_offset() == a.storage_offset() + a.numel() for a, b in itertools.pairwise(views))
            if views and adjacent:
                start = views[0].storage_offset() - flat.storage_offset()
                out.append(flat[start : start + sum(v.numel() for v in views)])
            else:
                out.append(torch.cat(views) if views else flat[:0])
        return out

    # -- the stepper face --------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """Scale, backward, and (fp32 accumulation) move the 16-bit gradients into the fp32 buffer."""
        self.loss_scaler.scale_loss(loss).backward(retain_graph=retain_graph)
        self._absorb()

    def _absorb_during_backward(self) -> list[Any]:
        """One post-accumulate-grad hook per trained parameter: its finished 16-bit gradient goes into the fp32
        view and is freed (autograd has summed this backward's contributions to it by then)."""
        handles = []
        for view, p in zip(self.master_grads.views, self._train_model, strict=True):

            def move(param: torch.Tensor, view: torch.Tensor = view) -> None:
                with torch.no_grad():
                    view.add_(param.grad)
                param.grad = None

            handles.append(p.register_post_accumulate_grad_hook(move))
        return handles

    def destroy(self) -> None:
        """Remove the `immediate_grad_update` hooks from the parameters (`engine.destroy()`); the optimizer
        must not be used afterwards."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def after_backward(self) -> None:
        """After a backward the engine did not run (`engine._backward_epilogue()`): move the gradients in."""
        self._absorb()

    def _absorb(self) -> None:
        if self._absorb_into is None:
            return
        pairs = [
            (view, p.grad) for view, p in zip(self._absorb_into, self._train_model, strict=True) if p.grad is not None
        ]
        if pairs:
            views, grads = zip(*pairs, strict=True)
            torch._foreach_add_(list(views), list(grads))
        for p in self._train_model:
            p.grad = None

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """All-reduce the accumulated gradients now (`engine.allreduce_gradients()`); the step then skips it."""
        if self._reduced:
            return
        self._absorb()
        self.accum.rebind()
        if self.reducers:
            self.timers.start("allreduce")
            for reducer in self.reducers:
                reducer.all_reduce()
            self.timers.stop("allreduce")
        self._reduced = True

    @torch.no_grad()
    def step(self, skip: torch.Tensor | None = None) -> bool:
        """The boundary step; False (and the scale updated) when gradients overflowed or `skip` is set.

        Args:
            skip: a 1-element flag already agreed by every rank that must skip together (the pipeline's
                stages); non-zero skips this step as an overflow would.
        """
        self.reduce_gradients()
        self._reduced = False
        grads = self.master_grads.flat
        if self.accum is not self.master_grads:
            grads.copy_(self.accum.flat)
        outcome = finish_step(
            [grads],
            scaler=self.loss_scaler,
            clip=self.clip_grad,
            check_overflow=self.check_overflow,
            compute_norm=True,
            skip=skip,
            model_parallel_group=self.model_parallel_group,
            model_parallel_grads=self._cut_grads,
        )
        if not self._record_outcome(outcome):
            return False
        self.optimizer.step()
        torch._foreach_copy_(self.model_params, self.masters)
        self.zero_grad()
        return True

    def fp32_grad_of(self, param: torch.Tensor) -> torch.Tensor | None:
        """`param`'s gradient accumulated so far in this window, in fp32 (a copy), as `safe_get_full_grad` reads
        it at stage 0: this rank's own until the step all-reduces it (as `param.grad` is at fp32 stage 0).
        With fp32 accumulation (bf16's default) the 16-bit `.grad` has been moved into the fp32 buffer after
        each backward, so it is read there. None for a parameter this optimizer does not train, or before
        any backward of the window with 16-bit accumulation."""
        i = self._train_index.get(id(param))
        if i is None:
            return None
        if self.accum is self.master_grads:
            return self.master_grads.views[i].clone()
        grad = param.grad
        return None if grad is None else grad.detach().to(torch.float32, copy=True)

    @torch.no_grad()
    def set_fp32_grad_of(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Replace `param`'s accumulated gradient with `value` (`safe_set_full_grad` at stage 0)."""
        i = self._train_index.get(id(param))
        if i is None:
            return
        if self.accum is self.master_grads:
            self.master_grads.views[i].copy_(value)
        elif param.grad is not None:
            param.grad.copy_(value)
        else:
            param.grad = value.detach().to(param.dtype, copy=True).view(param.shape)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the accumulated gradients.

        fp32 accumulation zeroes the fp32 buffer (backward adds into it); 16-bit accumulation
        releases the parameters' `.grad` (the next boundary copies fresh ones in, and overwrites
        the fp32 master gradients from them).
        """
        self._reduced = False
        if self.accum is self.master_grads:
            self.master_grads.zero_()
            for p in self._train_model:
                p.grad = None
        else:
            self.accum.release()

    # -- checkpoints -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """DeepSpeed's FP16_Optimizer layout: scaler state, the base optimizer's state, the fp32 masters."""
        return {
            "dynamic_loss_scale": self.loss_scaler.dynamic,
            "cur_scale": self.loss_scaler.cur_scale,
            "cur_iter": self.loss_scaler.cur_iter,
            "loss_scaler": self.loss_scaler.state_dict(),
            "optimizer_state_dict": self.optimizer.state_dict(),
            "fp32_groups": [[m.detach().clone() for m in g["params"]] for g in self.optimizer.param_groups],
            "clip_grad": self.clip_grad,
            **({_UC_INFO: info} if (info := self._get_universal_checkpoint_info()) is not None else {}),
        }

    def state_params(self) -> list[torch.Tensor]:
        """The model parameters `state_dict()`'s indices (and `fp32_groups` entries) stand for, in order."""
        return list(self.model_params)

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any], *, load_from_fp32_weights: bool = True) -> None:
        """Restore the scaler and base optimizer; masters from the saved fp32 copies (or from the module)."""
        # DeepSpeed's FP16_Optimizer keeps the scaler's fields at the top level, without "loss_scaler".
        scaler = state.get("loss_scaler") or {"cur_scale": state["cur_scale"], "cur_iter": state.get("cur_iter", 0)}
        self.loss_scaler.load_state_dict(scaler)
        self.optimizer.load_state_dict(state["optimizer_state_dict"])
        if load_from_fp32_weights:
            saved = [t for group in state["fp32_groups"] for t in group]
            if len(saved) != len(self.masters):
                raise ValueError(f"checkpoint has {len(saved)} fp32 master tensors, this model has {len(self.masters)}")
            torch._foreach_copy_(self.masters, saved)
            torch._foreach_copy_(self.model_params, self.masters)
        else:
            self.refresh_from_module()

    @torch.no_grad()
    def refresh_from_module(self) -> None:
        torch._foreach_copy_(self.masters, self.model_params)
