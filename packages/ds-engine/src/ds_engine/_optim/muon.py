"""DeepSpeed's `"optimizer": {"type": "Muon"}`: which parameters Muon takes, and the param groups it gets.

Why tagging: Muon is defined on hidden weight matrices only. As DeepSpeed 0.19.8 does at
`initialize()`, every parameter of the model gets `use_muon`: True for parameters with 2 or more
dims whose name contains neither "embed" nor "lm_head" (the input embedding and the output head
are matrices but belong with Adam), False otherwise. `per_head_muon: true` also tags the
attention projections with their head counts (`_optim.per_head`). Each incoming param group is then split into
its Muon half and its Adam half, so per-group settings (a no-decay group for biases) survive.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ds_engine._optim.per_head import tag_attention_heads

logger = logging.getLogger(__name__)

__all__ = ["MUON_CONFIG_KEYS", "check_muon_params", "muon_param_groups", "tag_muon_params"]

_MUON_KEYS = ("lr", "momentum", "weight_decay", "ns_method", "ns_steps")
_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")
MUON_CONFIG_KEYS = frozenset({*_MUON_KEYS, *_ADAM_KEYS, "muon_lr", "adam_lr", "adam_w_mode", "per_head_muon"})
"""`optimizer.params` keys of the Muon type (`ns_steps` is ds's; DeepSpeed 0.19.8 always runs 5 steps)."""


def _layer_shape(p: torch.Tensor) -> tuple[int, ...]:
    # A ZeRO-3 partitioned parameter is flat; its layer shape is recorded as `ds_shape`.
    shape = getattr(p, "ds_shape", None)
    return tuple(p.shape) if shape is None else tuple(shape)


def tag_muon_params(module: torch.nn.Module, *, per_head: bool = False, tp_size: int = 1) -> dict[str, str]:
    """Set `use_muon` on every parameter of `module` (DeepSpeed's rule, module docstring), and with
    `per_head` (`optimizer.params.per_head_muon`) `muon_num_heads` on its attention projections
    (`_optim.per_head`; None everywhere otherwise). Returns the per-head tags (name -> description).

    Raises:
        ValueError: `per_head` and no projection could be tagged.
    """
    for name, p in module.named_parameters():
        lowered = name.lower()
        p.use_muon = len(_layer_shape(p)) >= 2 and "embed" not in lowered and "lm_head" not in lowered  # type: ignore[attr-defined]
        p.muon_num_heads = None  # type: ignore[attr-defined]
    return tag_attention_heads(module, tp_size=tp_size) if per_head else {}


def check_muon_params(params: dict[str, Any]) -> tuple[str, str] | None:
    """The first bad `optimizer.params` key of a Muon config and why, or None when they are acceptable.

    Returns:
        `(key, message)`.
    """
    for key in params:
        if key not in MUON_CONFIG_KEYS:
            import difflib

            close = difflib.get_close_matches(key, sorted(MUON_CONFIG_KEYS), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else f"; accepted: {', '.join(sorted(MUON_CONFIG_KEYS))}"
            return key, f"{key!r} is not a parameter of optimizer 'muon'{hint}"
    if not isinstance(params.get("per_head_muon", False), bool):
        return "per_head_muon", f"per_head_muon must be true or false, got {params['per_head_muon']!r}"
    method = params.get("ns_method", "gram")
    if method not in ("gram", "standard"):
        return "ns_method", f"ns_method must be 'gram' or 'standard', got {method!r}"
    return None


def muon_param_groups(groups: list[dict[str, Any]], params: dict[str, Any]) -> list[dict[str, Any]]:
    """Split each param group into a `use_muon=True` and a `use_muon=False` group.

    Settings, most specific last: the config's shared value (`lr`, `weight_decay`, ...), then
    `muon_lr` / `adam_lr`, then the incoming group's own keys. Groups are named `muon-params` /
    `adam-params` (prefixed by the group's `name`, or `group<i>` when there are several).

    Raises:
        ValueError: a parameter has no `use_muon` tag (it is not part of the model given to initialize()).
    """
    missing = [p for g in groups for p in g["params"] if not hasattr(p, "use_muon")]
    if missing:
        raise ValueError(
            f"optimizer type Muon needs every parameter tagged with use_muon, and {len(missing)} are not: "
            "initialize() tags the parameters of the model it is given, so model_parameters holds parameters "
            "that model does not; set `param.use_muon = True/False` on them or make them part of the model"
        )
    halves = []
    for use_muon, label, keys, override in (
        (True, "muon", _MUON_KEYS, "muon_lr"),
        (False, "adam", _ADAM_KEYS, "adam_lr"),
    ):
        defaults = {k: params[k] for k in keys if k in params}
        if override in params:
            defaults["lr"] = params[override]
        halves.append((use_muon, label, keys, defaults))
    out: list[dict[str, Any]] = []
    for index, group in enumerate(groups):
        own = {k: v for k, v in group.items() if k != "params"}
        trainable = [p for p in group["params"] if p.requires_grad]
        for use_muon, label, keys, defaults in halves:
            half = [p for p in trainable if bool(p.use_muon) is use_muon]
            if not half:
                continue
            settings = {**defaults, **{k: v for k, v in own.items() if k in keys}}
            prefix = own.get("name") or (f"group{index}" if len(groups) > 1 else None)
            name = f"{prefix}-{label}-params" if prefix else f"{label}-params"
            out.append({"params": half, "use_muon": use_muon, "name": name, **settings})
    return out
