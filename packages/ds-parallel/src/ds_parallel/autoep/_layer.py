"""`AutoEPMoELayer`: a Hugging Face MoE block rebuilt for expert parallelism, same function, same inputs.

Forward on `[B, S, H]`:
  1. the router picks `top_k` experts and weights per token (replicated on every rank);
  2. the T*k (token, expert) assignments are sorted by expert, and each rank sends the rows for experts it
     does not own to their owner (one count exchange + one variable-split all-to-all on the expert-parallel
     group); expert-parallel rank r owns the contiguous experts [r*E/ep, (r+1)*E/ep);
  3. the owner runs its experts on the rows grouped by local expert and sends the results back (the
     reverse all-to-all); with ep_size 1 there is no exchange;
  4. results are weighted (score_apply "post"; "pre" weights the inputs instead) and summed per token;
     shared experts (and their sigmoid gate) are added, as the original block does.
Nothing is dropped or padded, so the output equals the original block's up to summation order.

Expert parameters carry DeepSpeed's expert mark (`allreduce = False`, `group_name = "ep_size_{N}"`): the
engine sums their gradients over the expert-data-parallel group; router and shared-expert parameters stay
dense (`allreduce = True`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed import ProcessGroup

import ds_comm
from ds_parallel.autoep._experts import GroupedExperts, all_to_all_v
from ds_parallel.autoep._fold import folded_expert_rows
from ds_parallel.autoep._fold_families import mark_autoep_folding_router_parameter
from ds_parallel.autoep._folding import FoldingGroupHandles
from ds_parallel.autoep._parts import layer_parts
from ds_parallel.autoep._router import TopKRouter
from ds_parallel.autoep._split_plan import compute_split_plan

__all__ = [
    "AutoEPMoELayer",
    "MoELayerSpec",
    "apply_scores_before_experts_if_enabled",
    "combine_from_routed",
    "resolve_score_apply_mode",
]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoELayerSpec:
    """One detected MoE block, resolved: what was found and how it will route."""

    moe_module_name: str
    model_family: str
    num_experts: int
    top_k: int
    hidden_size: int
    ffn_hidden_size: int
    score_func: Literal["softmax", "sigmoid"]
    score_apply: Literal["pre", "post"]
    route_norm: bool
    route_scale: float = 1.0
    num_expert_groups: int | None = None
    num_limited_groups: int | None = None
    group_score_func: Literal["max", "top2_sum"] = "top2_sum"
    expert_activation: str = "swiglu"
    shared_experts_name: str = ""
    shared_experts_gate_name: str = ""
    router_name: str = "gate"
    """The block's router child."""
    experts_name: str = "experts"
    """The block's experts child."""
    expert_storage: Literal["fused_3d", "module_list"] = "fused_3d"
    expert_w1_name: str = "gate_up_proj"
    """fused_3d: the gate (or fused gate+up) tensor; module_list: each expert's gate child."""
    expert_w2_name: str = "down_proj"
    expert_w3_name: str | None = None
    """The up projection, or None when gate and up are fused in `expert_w1_name`."""
    gate_bias: bool = False
    supports_expert_bias: bool = True
    """DeepSpeed's flag whether the family could carry an expert bias (load balancing); ds supports none."""
    has_shared_experts: bool = False
    return_router_logits: bool = False
    """DeepSpeed's router-logit capture (the block also returns its router logits); ds does not capture them."""
    router_logits_capture_target: Literal["moe_block", "router", "none"] = "none"
    router_logits_capture_index: int | None = None
    router_logits_capture_layer_name: str | None = None

    def __post_init__(self) -> None:
        if self.return_router_logits or self.router_logits_capture_target != "none":
            raise ValueError(
                f"AutoEP layer {self.moe_module_name!r}: returning or capturing router logits "
                f"(return_router_logits={self.return_router_logits}, router_logits_capture_target="
                f"{self.router_logits_capture_target!r}) is not implemented in ds; set the model config's "
                "output_router_logits=False"
            )


def resolve_score_apply_mode(spec: MoELayerSpec, config_override: Literal["auto", "pre", "post"]) -> str:
    """`expert_parallel.score_apply` when set ("pre"/"post"), else the layer's own."""
    return spec.score_apply if config_override == "auto" else config_override


def apply_scores_before_experts_if_enabled(
    routed_input: torch.Tensor, top_scores: torch.Tensor, score_apply: str
) -> torch.Tensor:
    """With "pre", the rows `[N, H]` times their routing weights `[N]` (in fp32, cast back); else the rows as
    they are."""
    if score_apply != "pre":
        return routed_input
    return (routed_input.float() * top_scores.reshape(-1, 1).float()).to(routed_input.dtype)


def combine_from_routed(
    expert_output: torch.Tensor,
    top_scores: torch.Tensor,
    token_indices_sorted: torch.Tensor,
    top_k: int,
    score_apply: Literal["pre", "post"],
    combine_impl: Literal["weighted_sum", "legacy_bmm"],
    shape: tuple[int, int, int],
) -> torch.Tensor:
    """Put the expert outputs back in token order and sum each token's `top_k` results (DeepSpeed's name).

    Args:
        expert_output: `[T*top_k, H]`, row i is the result for flat assignment `token_indices_sorted[i]`
            (assignment `t*top_k + k` is token t's k-th choice).
        top_scores: `[T, top_k]` routing weights; applied here when `score_apply` is "post" (in at least fp32, then
            cast back), ignored for "pre" (already applied to the inputs).
        combine_impl: "weighted_sum" (weight each slot, then sum) or "legacy_bmm" (one batched matmul); the same
            function up to rounding.
        shape: `(B, S, H)` of the result, B*S = T.
    """
    bsz, seqlen, hidden = shape
    tokens = bsz * seqlen
    flat = expert_output.new_zeros((tokens * top_k, hidden)).index_copy(0, token_indices_sorted, expert_output)
    per_slot = flat.reshape(tokens, top_k, hidden)
    acc = torch.promote_types(expert_output.dtype, torch.float32)  # fp32 at least; fp64 stays fp64
    if score_apply != "post":
        out = per_slot.sum(dim=1)
    elif combine_impl == "legacy_bmm":
        out = torch.bmm(top_scores.reshape(tokens, 1, top_k).to(acc), per_slot.to(acc)).squeeze(1)
    else:
        out = (per_slot.to(acc) * top_scores.reshape(tokens, top_k, 1).to(acc)).sum(dim=1)
    return out.to(expert_output.dtype).reshape(bsz, seqlen, hidden)


class AutoEPMoELayer(nn.Module):
    """The expert-parallel replacement of one MoE block (see the module docstring).

    Built from its parts (ds's form) or, as DeepSpeed builds it, from the source block:
    `AutoEPMoELayer(spec, source_module, ep_size, ep_rank, config)`, where `config` (an `AutoEPConfig`) may
    override the spec's `score_apply` and `route_norm` and sets `validate_folding_routing`.

    Args:
        spec: the resolved layer.
        source_module: DeepSpeed's form: the block to take the router and this rank's experts from.
        config: DeepSpeed's form: the `expert_parallel` settings (`AutoEPConfig`).
        router: its router, gate weights copied from the block.
        experts: this rank's experts (`spec.num_experts // ep_size` of them).
        shared_experts / shared_experts_gate: the block's own modules, kept as they are (or None).
        ep_size / ep_rank / ep_group: the expert-parallel degree, this rank's place, and its group.

    Raises:
        TypeError: neither a source module nor the router and experts, or both.
    """

    def __init__(
        self,
        spec: MoELayerSpec,
        source_module: nn.Module | None = None,
        ep_size: int = 1,
        ep_rank: int = 0,
        config: Any = None,
        *,
        router: TopKRouter | None = None,
        experts: GroupedExperts | None = None,
        shared_experts: nn.Module | None = None,
        shared_experts_gate: nn.Module | None = None,
        ep_group: ProcessGroup | None = None,
    ) -> None:
        if (source_module is None) == (router is None or experts is None):
            raise TypeError(
                "AutoEPMoELayer takes either the source block (spec, source_module, ep_size, ep_rank, config) or "
                "its parts (spec, router=..., experts=..., ...), not both and not neither"
            )
        coeff = getattr(config, "load_balance_coeff", None)
        if coeff is not None:
            raise ValueError(
                f"AutoEP layer {spec.moe_module_name!r}: expert_parallel.load_balance_coeff={coeff!r} is not supported "
                "(load_balance_coeff/expert_bias, auxiliary-loss-free load balancing, is not implemented in ds); "
                "set it to null or omit the key"
            )
        if source_module is not None:
            if config is not None:
                overrides = {"score_apply": resolve_score_apply_mode(spec, getattr(config, "score_apply", "auto"))}
                if getattr(config, "route_norm", None) is not None:
                    overrides["route_norm"] = config.route_norm
                spec = dataclasses.replace(spec, **overrides)
            parts = layer_parts(source_module, spec, ep_size=ep_size, ep_rank=ep_rank)
            router, experts = parts["router"], parts["experts"]
            shared_experts, shared_experts_gate = parts["shared_experts"], parts["shared_experts_gate"]
        assert router is not None and experts is not None
        super().__init__()
        self.spec = spec
        self.router = router
        self.experts = experts
        self.shared_experts = shared_experts
        self.shared_experts_gate = shared_experts_gate
        self.num_experts = spec.num_experts
        self.top_k = spec.top_k
        self.score_apply = spec.score_apply
        self.ep_size = ep_size
        self.ep_rank = ep_rank
        self.ep_group = ep_group
        self.num_local_experts = spec.num_experts // ep_size
        self.ep_group_name = f"ep_size_{ep_size}"
        self._is_autoep_layer = True  # DeepSpeed's marker of an AutoEP layer
        self.folding_group_handles: FoldingGroupHandles | None = None
        """Set by `enable_folding` (AutoEP folded with AutoTP); None otherwise."""
        self.tp_group: ProcessGroup | None = None
        self.tp_size = 1
        self.tp_rank = 0
        self.validate_folding_routing = bool(getattr(config, "validate_folding_routing", False))
        """Check on every folded forward that the lanes routed alike (`expert_parallel.validate_folding_routing`)."""
        # DeepSpeed's expert mark, read by the engine's MoE wiring, and its ZeRO-3 placement family: experts are
        # partitioned over their expert-data-parallel group, the rest over the data-parallel group
        for p in self.experts.parameters():
            setattr(p, "allreduce", False)  # noqa: B010
            setattr(p, "group_name", self.ep_group_name)  # noqa: B010
            setattr(p, "ds_zero_placement_family", "autoep_expert")  # noqa: B010
            setattr(p, "ds_zero_partition_group_name", self.ep_group_name)  # noqa: B010
        dense = [*self.router.parameters()]
        for extra in (shared_experts, shared_experts_gate):
            if extra is not None:
                dense += list(extra.parameters())
        for p in dense:
            setattr(p, "allreduce", True)  # noqa: B010
            setattr(p, "ds_zero_placement_family", "replicated")  # noqa: B010
        for p in self.router.parameters():  # DeepSpeed's family mark (the checkpoint record's router family)
            mark_autoep_folding_router_parameter(p)

    @property
    def local_experts(self) -> range:
        """Global indices of the experts this rank holds."""
        return range(self.ep_rank * self.num_local_experts, (self.ep_rank + 1) * self.num_local_experts)

    def enable_folding(self, handles: FoldingGroupHandles, *, validate_routing: bool = False) -> None:
        """Run folded with AutoTP (`ds_parallel.autoep._fold`): each lane of `handles.tp_group` sends its share of
        the routed assignments over `handles.ep_group`, and the lanes' results are gathered back.
        `validate_routing`: check on every forward that the lanes routed alike (`check_lanes_routed_alike`).

        Raises:
            ValueError: `handles` are for another expert-parallel degree or rank.
        """
        if handles.spec.ep_size != self.ep_size or handles.ep_ranks.index(ds_comm.get_rank()) != self.ep_rank:
            raise ValueError(
                f"AutoEP layer {self.spec.moe_module_name!r} (ep_size {self.ep_size}, ep_rank {self.ep_rank}) "
                f"does not fit the folding groups {handles.ep_ranks} of ep_size {handles.spec.ep_size}"
            )
        self.folding_group_handles = handles
        self.ep_group = handles.ep_group
        self.tp_group = handles.tp_group
        self.tp_size = handles.spec.tp_size
        self.tp_rank = handles.tp_ranks.index(ds_comm.get_rank())
        self.validate_folding_routing = validate_routing

    def set_deepspeed_parallelism(
        self, use_data_before_expert_parallel_: bool = False, folding_group_handles: FoldingGroupHandles | None = None
    ) -> None:
        """Bind the expert-parallel group of this layer's degree (the engine calls it; a collective the first
        time a degree is seen). With `folding_group_handles` (DeepSpeed's form of `enable_folding`) bind those;
        a folded layer keeps its folding groups."""
        from ds_parallel.moe._groups import create_expert_groups

        if folding_group_handles is not None:
            self.enable_folding(folding_group_handles, validate_routing=self.validate_folding_routing)
        if self.folding_group_handles is not None:
            return
        groups = create_expert_groups(self.ep_size)
        if groups.ep_rank != self.ep_rank:
            raise RuntimeError(
                f"AutoEP layer {self.spec.moe_module_name!r} was built for expert-parallel rank {self.ep_rank}, "
                f"but this rank is {groups.ep_rank} of {self.ep_group_name}"
            )
        self.ep_group = groups.ep_group

    def _run_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows sorted by global expert, `counts[e]` each -> the experts' outputs in the same order."""
        if self.ep_size == 1:
            return self.experts(rows, counts.tolist())
        assert self.ep_group is not None
        plan = compute_split_plan(rows, self.num_experts, self.ep_size, self.num_local_experts, self.ep_group, counts)
        send, recv, recv_counts = plan.input_splits, plan.output_splits, plan.local_counts_by_source
        arrived = all_to_all_v(rows, self.ep_group, out_splits=recv, in_splits=send)
        # arrived is [source 0: its rows for local expert 0, 1, ...][source 1: ...]; group by local expert.
        owner = torch.arange(self.num_local_experts, device=rows.device).repeat(self.ep_size)
        expert_of_row = torch.repeat_interleave(owner, recv_counts.reshape(-1))
        order = torch.argsort(expert_of_row, stable=True)
        done = self.experts(arrived.index_select(0, order), plan.local_counts.tolist())
        back = done.index_select(0, torch.argsort(order))
        return all_to_all_v(back, self.ep_group, out_splits=send, in_splits=recv)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        weights, indices = self.router(x)
        flat = indices.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // self.top_k
        w = weights.reshape(-1).index_select(0, order).unsqueeze(1)
        if self.tp_size > 1:  # folded: each TP lane runs its share, every lane gets all rows back
            out_rows = folded_expert_rows(self, x, w, token, flat.index_select(0, order))
        else:
            rows = x.index_select(0, token)
            rows = apply_scores_before_experts_if_enabled(rows, w, self.score_apply)
            counts = torch.bincount(flat, minlength=self.num_experts)
            out_rows = self._run_experts(rows, counts)
        if self.score_apply == "post":
            out_rows = (out_rows.float() * w).to(x.dtype)
        out = torch.zeros_like(x).index_add(0, token, out_rows)
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            if self.shared_experts_gate is not None:
                shared = torch.sigmoid(self.shared_experts_gate(x)) * shared
            out = out + shared
        return out.reshape(shape)
