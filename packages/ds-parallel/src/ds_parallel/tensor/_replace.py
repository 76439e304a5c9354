"""`shard_model`: replace a model's linear layers with tensor-parallel ones, in place.

With a partition_config (`tensor_parallel.partition_config` / `preset_model`, see `_partition_config`),
its regex specs alone decide, as a plan does below (a spec's `shape` makes a sub-parameter layer,
`SubParamLinearLayer` / `SubParamLinearAllreduce`); it takes precedence over a plan, as in DeepSpeed.

With a Hugging Face tensor-parallel plan (`tp_plan`, see `_plan`), the plan alone decides: each
`nn.Linear` it names becomes column-parallel (`LinearLayer`, gathered when the style says so) or
row-parallel (`LinearAllreduce`; `LmHeadLinearAllreduce` for an output head), every other module stays
whole, the modules above the cut layers get their head and width attributes divided (step 3 below),
and in training the parameters the plan marks `replicated_with_grad_allreduce` get their gradients
summed over the group. The plan is checked whole before anything is replaced.

Without a plan, the recipe, in order (DeepSpeed's AutoTP, heuristic path):
  1. find the block types and their row-parallel layers (`_parser`);
  2. in every block instance, replace each `nn.Linear` by its tensor-parallel counterpart: row-parallel
     (`LinearAllreduce`), fused qkv / packed gate-up, or column-parallel (`LinearLayer`); MoE routers
     and low-rank projections stay whole;
  3. in every module of a block that now holds shards, divide the head and width attributes
     (`num_heads`, `embed_dim`, ...) so the model's own reshapes see the local sizes;
  4. at inference only, the output head (`lm_head` / `embed_out`) becomes row-parallel
     (`LmHeadLinearAllreduce`); in training it stays replicated, as in DeepSpeed.
Embeddings and norms stay replicated.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

import ds_comm
from ds_parallel.tensor._layers import (
    FusedQKVLinearLayer,
    GateUpPackLinearLayer,
    LinearAllreduce,
    LinearLayer,
    LmHeadLinearAllreduce,
    TensorParallelLayer,
)
from ds_parallel.tensor._mode import is_autotp_training_mode
from ds_parallel.tensor._parser import BlockPolicy, find_block_policies
from ds_parallel.tensor._partition_config import AutoTPConfig, PartitionType, TPLayerSpec
from ds_parallel.tensor._plan import PlanStyle, ResolvedPlan, resolve_plan
from ds_parallel.tensor._shard_sizes import TPMeta, shard_size
from ds_parallel.tensor._spec_plan import ResolvedSpecs, resolve_specs
from ds_parallel.tensor._subparam import SubParamLinearAllreduce, SubParamLinearLayer

logger = logging.getLogger(__name__)

__all__ = ["shard_model"]

#: Attributes that count heads or features of a sharded module (DeepSpeed's list); divided per rank.
HEAD_ATTRS = (
    "n_heads",
    "inner_dim",
    "num_heads",
    "num_kv",
    "num_attention_heads",
    "num_attn_heads",
    "all_head_size",
    "embed_dim",
    "hidden_size",
    "num_key_value_heads",
    "num_kv_heads",
    "kv_n_heads",
    "d_model",
    "num_attention_heads_per_partition",
    "num_multi_query_groups_per_partition",
    "hidden_size_per_partition",
)
_FUSED_QKV_NAMES = ("qkv_proj", "query_key_value", "attn.Wqkv", "self_attn.W_pack", "c_attn")
#: Blocks whose fused qkv is [q | k | v] (each section split by heads); others keep each head's q, k, v together.
_SECTIONED_QKV_BLOCKS = ("Phi3DecoderLayer", "GLMBlock", "MPTBlock", "MptBlock", "BaichuanLayer")
_UNSUPPORTED_QKV_BLOCKS = ("CodeGenBlock", "GPTBigCodeBlock", "QWenBlock")
_LM_HEAD_NAMES = ("lm_head", "embed_out")


def _keeps_whole(name: str, model_classes: str) -> bool:
    """MoE routers and low-rank attention projections stay replicated."""
    return (
        name in ("mlp.gate", "block_sparse_moe.gate")
        or "q_a_proj" in name
        or "kv_a_proj_with_mqa" in name
        or (name == "mlp.shared_expert_gate" and "Qwen2Moe" in model_classes)
    )


class _Sharder:
    def __init__(self, model: nn.Module, group: ProcessGroup, meta: TPMeta, training: bool) -> None:
        self.model = model
        self.group = group
        self.tp_size = ds_comm.get_world_size(group)
        self.tp_rank = ds_comm.get_rank(group)
        self.meta = meta
        self.training = training
        self.model_classes = " ".join(type(m).__name__ for m in model.modules())
        self.num_replaced = 0

    def linear(self, linear: nn.Linear, name: str, path: str, policy: BlockPolicy, block: nn.Module) -> nn.Module:
        if _keeps_whole(name, self.model_classes):
            return linear
        kwargs: dict[str, Any] = {"name": name, "tp_meta": self.meta, "training": self.training}
        self.num_replaced += 1
        if "gate_up_proj" in name or ("dense_h_to_4h" in name and "GLM" in self.model_classes):
            return GateUpPackLinearLayer(linear, self.group, **kwargs)
        if name in policy.row_parallel or name.lstrip(".") in policy.row_parallel or "down_proj" in name:
            return LinearAllreduce(linear, self.group, **kwargs)
        if any(fused in name for fused in _FUSED_QKV_NAMES):
            block_name = type(block).__name__
            if block_name in _UNSUPPORTED_QKV_BLOCKS:
                raise ValueError(f"AutoTP: the fused qkv layout of {block_name} ({path!r}) is not supported by ds")
            interleaved = block_name not in _SECTIONED_QKV_BLOCKS
            return FusedQKVLinearLayer(linear, self.group, interleaved=interleaved, **kwargs)
        return LinearLayer(linear, self.group, **kwargs)

    def block(self, block: nn.Module, policy: BlockPolicy, path: str) -> None:
        self._walk(block, policy, block, path, parent_key="")

    def _walk(self, module: nn.Module, policy: BlockPolicy, block: nn.Module, path: str, parent_key: str) -> None:
        for key, child in list(module.named_children()):
            child_path = f"{path}.{key}"
            if isinstance(child, TensorParallelLayer):
                continue
            if isinstance(child, nn.Linear):
                setattr(module, key, self.linear(child, f"{parent_key}.{key}", child_path, policy, block))
            else:
                self._walk(child, policy, block, child_path, parent_key=key)
                self._divide_head_attrs(child, key)

    def by_plan(self, resolved: ResolvedPlan) -> None:
        """Replace the layers a Hugging Face plan cuts (see `_apply`)."""
        self._apply({path: lambda m, p, s=style: self.plan_linear(m, p, s) for path, style in resolved.layers.items()})
        self._grad_allreduce(resolved.grad_allreduce)

    def by_specs(self, resolved: ResolvedSpecs) -> None:
        """Replace the layers a partition_config cuts (see `_apply`)."""
        self._apply({path: lambda m, p, s=spec: self.spec_linear(m, p, s) for path, spec in resolved.layers.items()})
        self._grad_allreduce(resolved.grad_allreduce)

    def _apply(self, layers: dict[str, Any]) -> None:
        """Replace each layer by what its builder makes, then divide the attributes of the modules above them."""
        for path, build in layers.items():
            parent_path, _, key = path.rpartition(".")
            parent = self.model.get_submodule(parent_path)
            setattr(parent, key, build(getattr(parent, key), path))
        for path, module in list(self.model.named_modules()):
            if path and not isinstance(module, TensorParallelLayer) and path not in layers:
                self._divide_head_attrs(module, path)

    def _grad_allreduce(self, names: tuple[str, ...]) -> None:
        if self.training:
            for name, param in self.model.named_parameters():
                if name in names:
                    param.register_hook(_GradAllReduce(self.group))

    def plan_linear(self, linear: nn.Linear, path: str, style: PlanStyle) -> nn.Module:
        kwargs: dict[str, Any] = {"name": path, "tp_meta": self.meta, "training": self.training}
        leaf = path.rpartition(".")[2]
        self.num_replaced += 1
        if style is PlanStyle.ROW:
            if leaf in _LM_HEAD_NAMES:
                return LmHeadLinearAllreduce(linear, self.group, **kwargs)
            return LinearAllreduce(linear, self.group, **kwargs)
        return LinearLayer(linear, self.group, gather_output=style is PlanStyle.COLUMN_GATHER, **kwargs)

    def spec_linear(self, linear: nn.Module, path: str, spec: TPLayerSpec) -> nn.Module:
        """The layer a partition_config spec asks for: sub-parameter cuts when it gives a `shape`."""
        kwargs: dict[str, Any] = {"name": path, "tp_meta": self.meta, "training": self.training}
        self.num_replaced += 1
        if spec.partition_type is PartitionType.ROW:
            if spec.shape is not None:
                return SubParamLinearAllreduce(
                    linear, self.group, shape=spec.shape, partition_dim=spec.get_partition_dim(), **kwargs
                )
            if path.rpartition(".")[2] in _LM_HEAD_NAMES:
                return LmHeadLinearAllreduce(linear, self.group, **kwargs)
            return LinearAllreduce(linear, self.group, **kwargs)
        if spec.shape is not None:
            return SubParamLinearLayer(
                linear, self.group, shape=spec.shape, partition_dim=spec.get_partition_dim(), **kwargs
            )
        return LinearLayer(linear, self.group, gather_output=spec.gather_output, **kwargs)

    def _divide_head_attrs(self, module: nn.Module, name: str) -> None:
        """A module over sharded layers sees local head counts and widths (its reshapes read them)."""
        if not any(isinstance(m, TensorParallelLayer) for m in module.modules()):
            return
        if any(p.dim() >= 3 for p in module.parameters()):
            return  # high-dimensional weights (conv patches) are never cut: their sizes stay whole
        for attr in HEAD_ATTRS:
            value = getattr(module, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                setattr(module, attr, shard_size(value, self.tp_size, self.meta, name, self.tp_rank))

    def lm_head(self) -> None:
        owner: nn.Module = self.model
        if not any(isinstance(getattr(owner, n, None), nn.Linear) for n in _LM_HEAD_NAMES):
            owner = getattr(self.model, "language_model", self.model)
        for n in _LM_HEAD_NAMES:
            head = getattr(owner, n, None)
            if isinstance(head, nn.Linear) and not isinstance(head, TensorParallelLayer):
                setattr(owner, n, LmHeadLinearAllreduce(head, self.group, tp_meta=self.meta, training=False))
                self.num_replaced += 1
                return


def _warn_uneven_heads(meta: TPMeta, tp_size: int, tp_rank: int) -> None:
    """Key/value heads that do not divide over the ranks split unevenly, whole heads per rank (DeepSpeed
    0.19.8 does the same); with more ranks than heads the last ranks hold no attention shard and their
    row-parallel all-reduce adds zeros. Correct either way, but attention no longer scales: say so once."""
    kv = meta.num_kv_heads
    if kv is None or kv % tp_size == 0 or tp_rank != 0:
        return
    per_rank = [kv // tp_size + (1 if r < kv % tp_size else 0) for r in range(tp_size)]
    logger.warning(
        "AutoTP: the model's %d key/value heads do not divide over %d tensor-parallel ranks; attention is split "
        "unevenly, %s whole heads per rank%s",
        kv,
        tp_size,
        "/".join(map(str, per_rank)),
        " (ranks without a head hold no attention shard)" if tp_size > kv else "",
    )


class _GradAllReduce:
    """A gradient hook summing a replicated parameter's gradient over the tensor-parallel group."""

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        ds_comm.all_reduce(grad, group=self.group)
        return grad


def shard_model(
    model: nn.Module,
    *,
    tp_group: ProcessGroup,
    training: bool | None = None,
    tp_grain_size: int = 1,
    model_config: Any = None,
    policies: list[BlockPolicy] | None = None,
    tp_plan: Mapping[str, str] | None = None,
    partition_config: AutoTPConfig | None = None,
) -> nn.Module:
    """Shard `model`'s linear layers over `tp_group` in place (DeepSpeed's automatic tensor parallelism).

    Every rank of `tp_group` must call this on a model holding the same weights (a seeded build, or
    weights loaded from one checkpoint); each keeps only its shard. Afterwards a forward issues one
    all-reduce per row-parallel layer on `tp_group` (and, in training, one per column-parallel layer in
    the backward), and the outputs equal the unsharded model's.

    Args:
        model: a transformer with its blocks in an `nn.ModuleList` (Hugging Face Llama, Mistral,
            Qwen2, OPT, ...); modified in place and returned.
        tp_group: the tensor-parallel group (ds-parallel's mesh dim "tp").
        training: shard for training (shards trainable, output head replicated) or inference (shards
            frozen, output head row-parallel); None: the process-wide `set_autotp_mode`.
        tp_grain_size: MLP and output-head shards are multiples of this.
        model_config: where head counts are read (default `model.config`).
        policies: the blocks to shard and their row-parallel layers (DeepSpeed's `injection_policy`);
            None: found automatically (`find_block_policies`).
        tp_plan: a Hugging Face tensor-parallel plan (pattern -> style, `extract_hf_tp_plan`); when
            given (and not empty) it decides alone which layers are cut and how, instead of `policies`.
        partition_config: regex layer specs (`tensor_parallel.partition_config` / `preset_model`, see
            `_partition_config`); when given it decides alone, ahead of `tp_plan` (DeepSpeed's priority).

    Returns:
        `model`, with `ds_autotp_parsed = True`.

    Raises:
        ValueError: an unsupported model family, no shardable block, a layer too small to split, or a plan
            style AutoTP does not support (each message names the model or layer; a plan is checked before
            any layer is replaced). Key/value heads that do not divide over the group split unevenly, whole
            heads per rank (a warning says so).
    """
    if getattr(model, "ds_autotp_parsed", False):
        return model
    training = is_autotp_training_mode() if training is None else training
    if ds_comm.get_world_size(tp_group) <= 1:
        model.ds_autotp_parsed = True  # type: ignore[assignment]
        return model
    meta = TPMeta.from_model_config(model_config or getattr(model, "config", None), tp_grain_size)
    _warn_uneven_heads(meta, ds_comm.get_world_size(tp_group), ds_comm.get_rank(tp_group))
    if partition_config is not None:
        sharder = _Sharder(model, tp_group, meta, training)
        sharder.by_specs(resolve_specs(model, partition_config, skip=(TensorParallelLayer,)))
    elif tp_plan:
        resolved = resolve_plan(model, tp_plan, skip=(TensorParallelLayer,))
        sharder = _Sharder(model, tp_group, meta, training)
        sharder.by_plan(resolved)
    else:
        by_type = {p.block_type: p for p in (find_block_policies(model) if policies is None else policies)}
        sharder = _Sharder(model, tp_group, meta, training)
        for path, module in list(model.named_modules()):
            policy = by_type.get(type(module))
            if policy is not None:
                sharder.block(module, policy, path)
        if not training:
            sharder.lm_head()
    model.ds_autotp_parsed = True  # type: ignore[assignment]
    logger.info(
        "AutoTP: %d linear layers of %s sharded over %d ranks (%s, %s)",
        sharder.num_replaced,
        type(model).__name__,
        sharder.tp_size,
        "training" if training else "inference",
        "by the partition_config"
        if partition_config is not None
        else "by the Hugging Face tp_plan"
        if tp_plan
        else "by the module-name policy",
    )
    return model
