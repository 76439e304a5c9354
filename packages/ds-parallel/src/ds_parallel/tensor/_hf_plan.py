"""A Hugging Face model's tensor-parallel plan, merged from the three places Transformers keeps it.

Transformers describes how to shard a model as a dict of module-path patterns (`*` for any layer
index) to styles (`"colwise"`, `"rowwise"`, ...). The plan is spread out: the config's
`base_model_tp_plan` covers the base model (paths relative to it, `layers.*.self_attn.q_proj`), the
model class's `_tp_plan` adds the head on top (`lm_head`), and an instance may carry its own `_tp_plan`
(set at load time; recent Transformers replace it with the base plan expanded under the `model.` prefix,
which drops the class's head entries from the instance). Reading any one of them loses entries, so
`extract_hf_tp_plan` merges all three, as DeepSpeed 0.19.8's `_get_hf_tp_plan` does:

* sources in the order config, class, instance; a later source's entry for the same pattern wins;
* an entry `model.<p>` is dropped when `<p>` is already in the merged plan (the same module, once
  relative to the base model and once to the wrapper);
* the instance plan is read from the instance's own attributes only (the class attribute is the
  class source); a source that is not a dict is ignored;
* an empty result is None (the caller then uses the name-based AutoTP policy).
"""

from __future__ import annotations

from typing import Any

__all__ = ["extract_hf_tp_plan"]

_PREFIX = "model."


def extract_hf_tp_plan(model: Any) -> dict[str, str] | None:
    """The model's merged Hugging Face tensor-parallel plan (pattern -> style), or None when it has none.

    Pure: reads `model.config.base_model_tp_plan`, `type(model)._tp_plan` and the instance's own
    `_tp_plan`, never modifies them, and works on any object (a model without a plan gives None).
    """
    config = getattr(model, "config", None)
    sources = (
        getattr(config, "base_model_tp_plan", None) if config is not None else None,
        getattr(type(model), "_tp_plan", None),
        getattr(model, "__dict__", {}).get("_tp_plan"),
    )
    merged: dict[str, str] = {}
    seen: set[str] = set()  # patterns with any `model.` prefix removed
    for plan in sources:
        if not isinstance(plan, dict):
            continue
        for pattern, style in plan.items():
            prefixed = pattern.startswith(_PREFIX)
            canonical = pattern[len(_PREFIX) :] if prefixed else pattern
            if prefixed and canonical in seen:
                continue
            merged[pattern] = style
            seen.add(canonical)
    return merged or None
