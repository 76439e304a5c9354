"""From a source MoE block to the parts of its `AutoEPMoELayer`: read the expert weights in any stored layout,
keep this rank's experts, copy the router.

Expert weights come as one module per expert (`gate_proj`/`up_proj`/`down_proj`, "module_list") or as stacked
3-D tensors ("fused_3d"): separate gate/up tensors, or one fused gate+up tensor in either orientation (see
`classify_fused_gate_up_layout`). Everything is normalized to `w1`/`w3` `[E, ffn, H]` and `w2` `[E, H, ffn]`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ds_parallel.autoep._experts import GroupedExperts
from ds_parallel.autoep._layout import classify_fused_gate_up_layout
from ds_parallel.autoep._router import TopKRouter

if TYPE_CHECKING:  # the layer module builds its parts from here, so the spec is only named for type checkers
    from ds_parallel.autoep._layer import MoELayerSpec

__all__ = ["layer_parts", "repack_expert_weights"]

logger = logging.getLogger(__name__)


def _expert_weights(
    experts: nn.Module, w1_name: str, w2_name: str, w3_name: str | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The block's full (w1 gate, w2 down, w3 up) as `[E, ffn, H]`, `[E, H, ffn]`, `[E, ffn, H]`, or None."""
    if isinstance(experts, nn.ModuleList):
        first = experts[0] if len(experts) else None
        if first is None or not all(hasattr(first, n) for n in ("gate_proj", "up_proj", "down_proj")):
            return None

        def stack(proj: str) -> torch.Tensor:
            return torch.stack([getattr(e, proj).weight.detach() for e in experts])

        return stack("gate_proj"), stack("down_proj"), stack("up_proj")
    w1, w2 = getattr(experts, w1_name, None), getattr(experts, w2_name, None)
    if not (isinstance(w1, torch.Tensor) and isinstance(w2, torch.Tensor) and w1.dim() == 3 and w2.dim() == 3):
        return None
    w1, w2 = w1.detach(), w2.detach()
    if w3_name is not None:
        w3 = getattr(experts, w3_name, None)
        return (w1, w2, w3.detach()) if isinstance(w3, torch.Tensor) else None
    layout = classify_fused_gate_up_layout(w1.shape, w2.shape)
    if layout is not None:
        ffn = layout.ffn_hidden_size
        if not layout.needs_transpose:  # [E, 2F, H] gate then up, down [E, H, F]
            return w1[:, :ffn], w2, w1[:, ffn:]
        # [E, H, 2F] and down [E, F, H]: the matmul orientation
        return w1[:, :, :ffn].transpose(1, 2), w2.transpose(1, 2), w1[:, :, ffn:].transpose(1, 2)
    logger.debug("AutoEP: unrecognized expert layout %s / %s", tuple(w1.shape), tuple(w2.shape))
    return None


def _requires_grad(experts: nn.Module, spec: MoELayerSpec) -> tuple[bool, bool, bool]:
    """Whether the block's gate, down and up expert weights train (frozen experts stay frozen).

    Raises:
        ValueError: a module-list block's experts disagree about one projection.
    """
    if isinstance(experts, nn.ModuleList):
        flags = []
        for proj in ("gate_proj", "down_proj", "up_proj"):
            seen = {bool(getattr(e, proj).weight.requires_grad) for e in experts}
            if len(seen) > 1:
                raise ValueError(
                    f"AutoEP: the experts' {proj} weights have mixed requires_grad flags; freeze all or none"
                )
            flags.append(seen.pop())
        return flags[0], flags[1], flags[2]
    w1, w2 = getattr(experts, spec.expert_w1_name), getattr(experts, spec.expert_w2_name)
    w3 = getattr(experts, spec.expert_w3_name) if spec.expert_w3_name is not None else w1
    return bool(w1.requires_grad), bool(w2.requires_grad), bool(w3.requires_grad)


def _router_weight(router: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    weight = getattr(router, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None
    bias = getattr(router, "bias", None)
    return weight.detach(), bias.detach() if isinstance(bias, torch.Tensor) else None


def layer_parts(module: nn.Module, spec: MoELayerSpec, *, ep_size: int, ep_rank: int) -> dict[str, Any]:
    """The new layer's modules from the source block: `router` (the gate's weights copied), `experts` (this
    rank's, views of the source weights), and the block's own `shared_experts` / `shared_experts_gate` (or None)."""
    router_src = getattr(module, spec.router_name)
    weight, bias = _router_weight(router_src)  # type: ignore[misc]
    router = TopKRouter(
        spec.hidden_size,
        spec.num_experts,
        top_k=spec.top_k,
        score_func=spec.score_func,
        route_norm=spec.route_norm,
        route_scale=spec.route_scale,
        gate_bias=bias is not None,
        num_expert_groups=spec.num_expert_groups,
        num_limited_groups=spec.num_limited_groups,
        group_score_func=spec.group_score_func,
    ).to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        router.gate.weight.copy_(weight)
        if bias is not None:
            router.gate.bias.copy_(bias)
    for param, source in (
        (router.gate.weight, router_src.weight),
        (router.gate.bias, getattr(router_src, "bias", None)),
    ):
        if param is not None and isinstance(source, torch.Tensor):
            param.requires_grad_(source.requires_grad)
    correction = getattr(router_src, "e_score_correction_bias", None)
    if isinstance(correction, torch.Tensor):
        router.e_score_correction_bias = correction.detach().clone()
    experts_src = getattr(module, spec.experts_name)
    w1, w2, w3 = repack_expert_weights(experts_src, spec, ep_rank, ep_size)
    act = getattr(experts_src, "act_fn", None) if isinstance(getattr(experts_src, "act_fn", None), nn.Module) else None
    experts = GroupedExperts(w1, w2, w3, activation=spec.expert_activation, gate_act=act)
    for param, trains in zip((experts.w1, experts.w2, experts.w3), _requires_grad(experts_src, spec), strict=True):
        param.requires_grad_(trains)
    return {
        "router": router,
        "experts": experts,
        "shared_experts": getattr(module, spec.shared_experts_name, None) if spec.shared_experts_name else None,
        "shared_experts_gate": getattr(module, spec.shared_experts_gate_name, None)
        if spec.shared_experts_gate_name
        else None,
    }


def repack_expert_weights(
    experts_source: nn.Module, spec: MoELayerSpec, ep_rank: int, ep_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's experts of a source block as (w1 gate, w2 down, w3 up), `[E_local, ffn, H]`, `[E_local, H, ffn]`,
    `[E_local, ffn, H]`: experts `[ep_rank * E/ep_size, (ep_rank + 1) * E/ep_size)`, views of the source weights.

    Raises:
        ValueError: the block's experts are not stored as `spec` says, or `ep_size` does not divide the experts.
    """
    if spec.num_experts % ep_size or not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_size={ep_size} must divide num_experts={spec.num_experts} and 0 <= ep_rank < ep_size")
    full = _expert_weights(experts_source, spec.expert_w1_name, spec.expert_w2_name, spec.expert_w3_name)
    if full is None:
        raise ValueError(
            f"AutoEP: {spec.moe_module_name}.{spec.experts_name} does not hold {spec.expert_storage} expert weights "
            f"named {spec.expert_w1_name!r}/{spec.expert_w2_name!r}/{spec.expert_w3_name!r}"
        )
    local = spec.num_experts // ep_size
    lo, hi = ep_rank * local, (ep_rank + 1) * local
    w1, w2, w3 = (w[lo:hi] for w in full)
    return w1, w2, w3
