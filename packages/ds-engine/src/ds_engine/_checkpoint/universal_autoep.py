"""Loading a universal checkpoint into a model with AutoEP layers, at any world size and any `autoep_size`.

The universal files hold each expert tensor whole (`zero/<prefix>.w1/fp32.pt`: `{"param": [num_experts, ...],
"is_expert_param": True, ...}`, ds-zero's `universal_autoep`); this rank's expert-parallel rank holds experts
`[lo, hi)` of it, under the ZeRO name `<prefix>.w1@experts{lo}:{hi}` (`_step.moe`). So the load reads every
parameter in the loading optimizer's order and names (`zero_param_shapes`), an expert range from its layer's
whole tensor cut to rows `[lo, hi)`, for the fp32 value and every optimizer state alike; ds-zero then
re-partitions that single-rank state onto this run's ranks (each expert range over its expert-data-parallel
group, the rest over the data-parallel group), as any checkpoint. The module's weights are the same fp32 values
(experts: this rank's local rows), cast to the module's dtypes.

The number of local experts must agree: a checkpoint of E experts loads at `autoep_size` s only into a model
whose layers hold E / s experts per rank (DeepSpeed's check, with its message).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ds_engine._checkpoint.constants import AUTOEP_EXPERT_KEY_PREFIX, AUTOEP_LAYERS_KEY, AUTOEP_NUM_EXPERTS
from ds_engine._optional import require
from ds_engine._step.moe import MoeWiring, expert_range_of

__all__ = ["read_autoep_universal"]


def _ranges(wiring: MoeWiring) -> dict[str, tuple[str, int, int, int]]:
    """ZeRO name of each local expert tensor -> (its module name, first expert, end, the layer's ep_size)."""
    out = {}
    for layer in wiring.layers:
        ep_size = layer.num_experts // layer.num_local_experts
        for name in layer.fused_experts:
            zero_name = wiring.expert_names[name]
            found = expert_range_of(zero_name)
            if found is None:  # every AutoEP tensor is renamed with its range by `moe_layout`
                raise AssertionError(f"AutoEP expert tensor {name} has no expert range in its checkpoint name")
            out[zero_name] = (*found, ep_size)
    return out


def _check_expert_counts(state: Mapping[str, Any], path: Path, wiring: MoeWiring) -> None:
    """Each AutoEP layer's local expert count against the checkpoint's, before anything is read.

    Raises:
        ValueError: the checkpoint's experts do not split into this model's local experts (names both counts).
    """
    saved = {
        e.get(AUTOEP_EXPERT_KEY_PREFIX): int(e[AUTOEP_NUM_EXPERTS])
        for e in state.get(AUTOEP_LAYERS_KEY) or []
        if isinstance(e, Mapping) and AUTOEP_NUM_EXPERTS in e
    }
    for layer in wiring.layers:
        prefix = f"{layer.prefix}.experts" if layer.prefix else "experts"
        if prefix not in saved:
            raise ValueError(
                f"checkpoint.load_universal: {path} records no AutoEP layer {prefix!r} (its ds_autoep_layers: "
                f"{sorted(k for k in saved if k)}); was it converted from a save of this model?"
            )
        ep_size = layer.num_experts // layer.num_local_experts
        if saved[prefix] % ep_size:
            raise ValueError(
                f"checkpoint.load_universal: AutoEP universal expert checkpoint tensor of {prefix!r} cannot be evenly "
                f"split across the target EP topology: checkpoint_num_experts={saved[prefix]}, target_ep_size={ep_size}"
            )
        if saved[prefix] // ep_size != layer.num_local_experts:
            raise ValueError(
                f"checkpoint.load_universal: AutoEP universal expert checkpoint tensor of {prefix!r} is incompatible "
                f"with target parameter shape: target_local_experts={layer.num_local_experts}, "
                f"checkpoint_local_experts={saved[prefix] // ep_size} (the checkpoint holds {saved[prefix]} experts, "
                f"this model {layer.num_experts} at expert_parallel.autoep_size={ep_size})"
            )


def read_autoep_universal(
    ckpt_dir: Path, state: Mapping[str, Any], path: Path, module: nn.Module, stepper: Any, wiring: MoeWiring
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """This rank's single-rank ZeRO partition of the universal checkpoint in `ckpt_dir`, and the module state_dict.

    Args:
        state / path: the checkpoint's model-states dict and file (its `ds_autoep_layers` give the expert counts).
        module / stepper / wiring: the loading engine's model, ZeRO stepper (its `optimizer`) and MoE wiring.

    Raises:
        ValueError: no optimizer, an AutoEP layer folded with tensor parallelism, a layer the checkpoint lacks,
            or a local expert count that differs from the checkpoint's (see `_check_expert_counts`).
    """
    if stepper is None:
        raise ValueError("checkpoint.load_universal into an AutoEP model needs an optimizer (ZeRO stage 1-3)")
    if wiring.folding is not None:
        raise ValueError(
            "checkpoint.load_universal into AutoEP layers folded with tensor parallelism is not supported (as in "
            "DeepSpeed); load the ZeRO checkpoint at the topology that saved it"
        )
    _check_expert_counts(state, path, wiring)
    ds_zero = require("ds_zero", extra="zero", feature="loading a universal checkpoint")
    ranges = _ranges(wiring)

    def cut(name: str, whole: torch.Tensor) -> torch.Tensor:
        found = ranges.get(name)
        if found is None:
            return whole
        _, lo, hi, _ = found
        return whole[lo:hi]

    shapes = ds_zero.zero_param_shapes(stepper.optimizer, module)
    partitions = ds_zero.load_universal_partitions(
        ckpt_dir, param_shapes=shapes, transform=cut, source_names={n: r[0] for n, r in ranges.items()}
    )
    full = ds_zero.consolidate_fp32_params(partitions)
    saved = state.get("module") or {}
    module_state = type(saved)((k, full[k].to(v.dtype) if k in full else v) for k, v in saved.items())
    params = dict(module.named_parameters())
    for layer in wiring.layers:
        for name in layer.fused_experts:
            module_state[name] = full[wiring.expert_names[name]].to(params[name].dtype)
    return partitions, module_state
