"""The ZeRO seam (typed in `_zero_contract`): what initialize() builds from ds-zero, and nothing else.

Four things cross it, all decided once at initialize():
  * the ZeRO optimizer around the base optimizer (stages 1-3, training);
  * `DeepSpeedZeRoOffload` for a stage-3 model without an optimizer (evaluation: the parameters are
    still partitioned and gathered around each module's forward), as DeepSpeed does;
  * the rank-0 broadcast of a stage-3 model's not-yet-partitioned parameters and buffers, so that a
    model built outside `zero.Init` is partitioned from one set of values;
  * with NVMe offload (ZeRO-Infinity), the top-level `aio` section, passed as `aio_config=` (a dict)
    to the stage-3 constructors: the contract between ds-engine and ds-zero's NVMe swappers (every
    ds-zero in the range the `zero` extra declares takes it).
ds-zero is imported only inside these functions, through `require`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.optim import Optimizer

from ds_engine._linear.engine_hooks import replicated
from ds_engine._optional import require
from ds_engine._plan.dist_info import DistInfo
from ds_engine._plan.plan import AssemblyPlan, reduction_dtype
from ds_engine._step.data_parallel import broadcast_module_states
from ds_engine._step.moe import MoeWiring
from ds_engine._step.zero_contract import ZeroOptimizer, ZeroOptimizerFactory
from ds_ops.precision import DynamicLossScaler, LossScaler

if TYPE_CHECKING:
    from ds_engine.config import DeepSpeedConfig

logger = logging.getLogger(__name__)

__all__ = [
    "broadcast_unpartitioned",
    "build_parameter_offload",
    "build_zero_optimizer",
    "loss_scaler_for",
    "nvme_kwargs",
]


def loss_scaler_for(plan: AssemblyPlan) -> LossScaler:
    """The loss scaler the plan asks for (dynamic for fp16 with `loss_scale` 0, else static)."""
    if plan.dynamic_loss_args is not None:
        return DynamicLossScaler(**plan.dynamic_loss_args)
    return LossScaler(plan.static_loss_scale or 1.0)


def _ds_zero(stage: int, what: str) -> Any:
    ds_zero = require("ds_zero", extra="zero", feature=f"ZeRO stage {stage}")
    if getattr(ds_zero, what, None) is None:
        raise ImportError(
            f"ZeRO stage {stage} needs ds_zero.{what}, which the installed ds-zero "
            f"{getattr(ds_zero, '__version__', '?')} does not provide; pip install -U 'ds-engine[zero]'"
        )
    return ds_zero


def _nvme_keys(config: DeepSpeedConfig) -> list[str]:
    z = config.zero
    return [
        key
        for key, device in (
            ("offload_param", z.offload_param_device),
            ("offload_optimizer", z.offload_optimizer_device),
        )
        if device == "nvme"
    ]


def nvme_kwargs(config: DeepSpeedConfig) -> dict[str, Any]:
    """`{"aio_config": <the aio section as a dict>}` when stage 3 swaps to NVMe, else `{}`."""
    if not _nvme_keys(config):
        return {}
    return {"aio_config": config.parsed.aio.model_dump()}


def build_zero_optimizer(
    plan: AssemblyPlan,
    config: DeepSpeedConfig,
    base: Optimizer,
    module: nn.Module,
    dist: DistInfo,
    *,
    moe: MoeWiring | None = None,
    model_parallel: dict[str, Any] | None = None,
) -> ZeroOptimizer:
    """ds-zero's optimizer around `base`: `DeepSpeedZeroOptimizer` (stage 1/2) or `..._Stage3`; with a
    `zero_optimization.zenflow` section `ZenFlowZeroOptimizer` or `ZenFlowZeroOptimizer_Stage3`.

    With MoE layers (stage 1/2), each MoE param group is partitioned and reduced over its
    expert-data-parallel group (`partition_groups=`), and expert parameters are saved under their global
    expert names (`checkpoint_names=`), so a save loads at another expert-parallel degree. At stage 3 (AutoEP
    only) the expert parameters carry their partition group themselves (`_step.moe_zero3`). With tensor
    parallelism (stage 1/2), `model_parallel` holds `model_parallel_group=` and `model_parallel_params=`
    (the norm and the overflow flag span the tensor-parallel shards).

    Raises:
        ImportError: ds-zero is missing, or lacks the class (the message names the pip command).
    """
    name = "DeepSpeedZeroOptimizer_Stage3" if plan.zero_stage == 3 else "DeepSpeedZeroOptimizer"
    zenflow = getattr(config.zero.zero_config, "zenflow", None) is not None
    if zenflow:  # checked at config time (`config._zenflow_checks`): with CPU optimizer offload
        name = "ZenFlowZeroOptimizer_Stage3" if plan.zero_stage == 3 else "ZenFlowZeroOptimizer"
    cls: ZeroOptimizerFactory = getattr(_ds_zero(plan.zero_stage, name), name)
    m = config.parsed
    comm_dtype = reduction_dtype(config)
    extra = nvme_kwargs(config) if plan.zero_stage == 3 else {}
    if moe is not None and plan.zero_stage == 3:
        # AutoEP: the experts carry their placement (`_step.moe_zero3`); their fragments get global names
        extra["checkpoint_names"] = moe.expert_names
    elif moe is not None:
        extra = {"partition_groups": moe.partition_groups(base.param_groups), "checkpoint_names": moe.expert_names}
    extra.update(model_parallel or {})
    if plan.bf16_masters:  # the config checks allowed it (ZeRO 1-3, bf16; fp32 moments only with CPU offload)
        extra["bf16_master_weights_and_gradients"] = True
        extra["bf16_optimizer_states"] = plan.bf16_optimizer_states
    if plan.fp16_masters:  # the config checks allowed it (ZeRO 1-3, fp16, CPU optimizer offload)
        extra["fp16_master_weights_and_gradients"] = True
    if plan.zero_stage < 3:
        # `gradient_allreduce_op: "sum"` (refused at stage 3 by the config checks, as DeepSpeed refuses it).
        extra["gradient_average"] = m.gradient_allreduce_op == "mean"
    if zenflow and m.optimizer is not None:
        # The selective AdamW takes the config's optimizer params, as DeepSpeed builds it.
        extra["selective_optimizer_params"] = dict(m.optimizer.params)
    # The contract's calling convention for every stage (ds-zero's stage 3 also accepts DeepSpeed's module-first order).
    return cls(
        base,
        module=module,
        config=config.zero.zero_config,
        loss_scaler=loss_scaler_for(plan),
        clip_grad=plan.clip,
        check_overflow=plan.check_overflow,
        dp_group=dist.dp_group,
        gradient_predivide_factor=m.gradient_predivide_factor,
        communication_dtype=comm_dtype,
        **extra,
    )


def build_parameter_offload(config: DeepSpeedConfig, module: nn.Module, dist: DistInfo) -> Any:
    """Stage 3 without an optimizer: `ds_zero.DeepSpeedZeRoOffload(module, ...)` partitions and schedules.

    Parameters not partitioned yet (a model built outside `zero.Init`) are partitioned here; from
    then on every forward gathers a module's parameters just before it runs and releases them after.
    """
    ds_zero = _ds_zero(3, "DeepSpeedZeRoOffload")
    offload = ds_zero.DeepSpeedZeRoOffload(
        module, config=config.zero.zero_config, dp_group=dist.dp_group, **nvme_kwargs(config)
    )
    logger.info(
        "ZeRO stage 3 without an optimizer: parameters partitioned over %d ranks for evaluation", dist.dp_world_size
    )
    return offload


def broadcast_unpartitioned(module: nn.Module, dist: DistInfo) -> None:
    """Stage 3: broadcast the parameters `zero.Init` did not partition, and all buffers, from data-parallel rank 0.

    Every rank then partitions the same values (stage 1/2 broadcast everything in `_assembly`).
    Collective: one broadcast per bucket on the data-parallel group; every rank must call it.
    """
    if dist.dp_world_size <= 1:
        return
    is_zero_param = require("ds_zero", extra="zero", feature="ZeRO stage 3").is_zero_param
    tensors = [p for p in replicated(module.parameters()) if not is_zero_param(p)]
    broadcast_module_states([*tensors, *module.buffers()], src=dist.dp_src_rank, group=dist.dp_group)
