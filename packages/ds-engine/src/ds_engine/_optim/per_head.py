"""`optimizer.params.per_head_muon`: which attention projections Muon orthogonalizes head by head.

Why per head: an attention projection `[num_heads * head_dim, in_features]` is `num_heads` separate
maps stacked on the output dim; orthogonalizing the whole matrix makes the heads share one update
direction. With `per_head_muon: true` DeepSpeed 0.19.8 tags each such projection with
`muon_num_heads` (the optimizers then run Newton–Schulz on the `[num_heads, head_dim, in]` batch)
and `muon_head_dim`; ds keeps those attribute names and its rules:

- The leaf module name claims a kind: `q_proj`/`query`/`wq` are query heads, `k_proj`/`key`/`wk`/
  `v_proj`/`value`/`wv` key/value heads, `q_b_proj`/`kv_b_proj` MLA up-projections. Fused QKV
  (`qkv_proj`, `query_key_value`, `c_attn`, `in_proj_qkv`, `wqkv`) and MLA down-projections
  (`q_a_proj`, `kv_a_proj*`) never split evenly into heads; output projections (heads on the input
  dim) are not claimed at all.
- The model's config (`text_config` when it has one) gives candidate geometries: query heads x
  `head_dim` (or `hidden_size / heads`), key/value heads x `head_dim`, and for MLA
  `qk_nope_head_dim + qk_rope_head_dim` (query) / `qk_nope_head_dim + v_head_dim` (key/value).
  A linear-attention module listed in `_LINEAR_ATTENTION_OWNERS` describes its own projections
  (`num_heads`, `num_k_heads`, `head_k_dim`, ...) and wins over the config.
- Only a candidate with `rows == heads * width` is taken; candidates that agree on the head count
  are one answer, ones that disagree leave the matrix whole. Under tensor parallelism (the module
  arrives sharded on dim 0) a shard holding whole heads of a candidate's width takes `rows / width`
  heads, which is the corresponding block of the whole matrix's per-head update.
- Turning it on and tagging nothing is an error (the feature would silently do nothing); claimed
  names no geometry confirmed are logged as a warning.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

logger = logging.getLogger(__name__)

__all__ = ["tag_attention_heads"]

_FUSED = ("qkv_proj", "query_key_value", "c_attn", "in_proj_qkv", "wqkv", "q_a_proj", "kv_a_proj")
_MLA_Q, _MLA_KV = ("q_b_proj",), ("kv_b_proj",)
_KV = ("k_proj", "key", "wk", "v_proj", "value", "wv")
_QUERY = ("q_proj", "query", "wq")
_VALUE = ("v_proj", "value", "wv")
_LINEAR_ATTENTION_OWNERS = frozenset({"KimiDeltaAttention"})
_HEAD_COUNTS = ("num_attention_heads", "num_heads", "n_head", "n_heads", "attention_heads")
_KV_COUNTS = ("num_key_value_heads", "num_kv_heads", "multi_query_group_num", "n_head_kv", "kv_n_heads")


def _first_int(obj: Any, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(obj, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
    return None


def _kind(leaf: str) -> str | None:
    """What a leaf module name claims to be (`fused`, `mla_q`, `mla_kv`, `kv`, `query`), or None."""
    for kind, prefixes in (("fused", _FUSED), ("mla_q", _MLA_Q), ("mla_kv", _MLA_KV), ("kv", _KV), ("query", _QUERY)):
        if leaf.startswith(prefixes):
            return kind
    return None


def _config_candidates(kind: str, config: Any) -> list[tuple[int, int, str]]:
    heads = _first_int(config, _HEAD_COUNTS)
    if heads is None:
        return []
    kv_heads = _first_int(config, _KV_COUNTS) or heads
    head_dim = _first_int(config, ("head_dim",))
    hidden = _first_int(config, ("hidden_size", "n_embd"))
    if head_dim is None and hidden is not None and hidden % heads == 0:
        head_dim = hidden // heads
    nope, rope, v_dim = (_first_int(config, (k,)) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    out = []
    if kind in ("query", "mla_q") and nope and rope:
        out.append((heads, nope + rope, "mla-q"))
    if kind == "mla_kv" and nope and v_dim:
        out.append((heads, nope + v_dim, "mla-kv"))
    if kind == "query" and head_dim:
        out.append((heads, head_dim, "head-dim"))
    if kind == "kv" and head_dim:
        out.append((kv_heads, head_dim, "head-dim"))
    return out


def _owner_candidates(kind: str, leaf: str, owner: nn.Module | None) -> list[tuple[int, int, str]]:
    if owner is None or kind not in ("query", "kv") or type(owner).__name__ not in _LINEAR_ATTENTION_OWNERS:
        return []
    counts = ("num_heads", "num_attention_heads", "n_heads")
    widths = ("head_k_dim", "head_dim", "head_size")
    if kind == "kv":
        counts = ("num_k_heads", "num_key_value_heads", "num_kv_heads", *counts)
        if leaf.startswith(_VALUE):
            counts, widths = ("num_v_heads", *counts), ("head_v_dim", "head_dim", "head_size")
    heads, width = _first_int(owner, counts), _first_int(owner, widths)
    return [(heads, width, "owner")] if heads and width else []


def _confirm(rows: int, candidates: list[tuple[int, int, str]], tp_size: int) -> tuple[int | None, str]:
    """The head count the shape confirms, with the reason (module docstring)."""
    if not candidates:
        return None, "no candidate geometry"
    exact = [c for c in candidates if rows == c[0] * c[1]]
    if not exact and tp_size > 1:
        exact = [(rows // c[1], c[1], f"{c[2]}, tensor-parallel shard") for c in candidates
                 if rows % c[1] == 0 and rows < c[0] * c[1]]  # fmt: skip
    if not exact:
        return None, "width mismatch"
    if len({c[0] for c in exact}) > 1:
        return None, "ambiguous: " + "/".join(f"{c[2]}={c[0]}" for c in exact)
    return exact[0][0], exact[0][2]


def tag_attention_heads(module: nn.Module, *, tp_size: int = 1) -> dict[str, str]:
    """Set `muon_num_heads` / `muon_head_dim` on the Muon attention projections of `module` (None elsewhere).

    Call after `use_muon` is set. Returns what was tagged (`name -> "H heads of D (reason)"`).

    Raises:
        ValueError: nothing could be tagged (no config with a head count, no recognized attention
            projection, or no geometry matching the shapes), naming what was examined.
    """
    config = getattr(module, "config", None)
    config = getattr(config, "text_config", None) or config
    owners = dict(module.named_modules())
    tagged: dict[str, str] = {}
    skipped: dict[str, str] = {}
    for name, p in module.named_parameters():
        p.muon_num_heads = None  # type: ignore[attr-defined]
        p.muon_head_dim = None  # type: ignore[attr-defined]
        shape = tuple(getattr(p, "ds_shape", None) or p.shape)
        parts = name.split(".")
        leaf = (parts[-2] if len(parts) >= 2 else parts[-1]).lower()
        kind = _kind(leaf)
        if not getattr(p, "use_muon", False) or kind is None:
            continue
        if kind == "fused" or len(shape) != 2:
            skipped[name] = "not split into uniform heads" if kind == "fused" else "not 2-D"
            continue
        owner = owners.get(".".join(parts[:-2])) if len(parts) >= 3 else None
        candidates = _owner_candidates(kind, leaf, owner) or (
            _config_candidates(kind, config) if config is not None else []
        )
        heads, reason = _confirm(shape[0], candidates, tp_size)
        if heads is None:
            skipped[name] = reason
            continue
        p.muon_num_heads = heads  # type: ignore[attr-defined]
        p.muon_head_dim = shape[0] // heads  # type: ignore[attr-defined]
        tagged[name] = f"{heads} heads of {shape[0] // heads} ({reason})"
    if not tagged:
        raise ValueError(
            "optimizer.params.per_head_muon: no attention projection of the model could be split into heads, so "
            "per-head Muon would do nothing; it needs q/k/v projections named like q_proj/k_proj/v_proj (or "
            "query/key/value, wq/wk/wv, q_b_proj/kv_b_proj) and a model.config with the head count "
            f"(num_attention_heads, head_dim or hidden_size) matching their shapes. Examined: {skipped or 'none'}; "
            "set per_head_muon to false to orthogonalize whole matrices"
        )
    unconfirmed = {k: v for k, v in skipped.items() if v != "not split into uniform heads"}
    if unconfirmed:
        logger.warning("per_head_muon: %s stay whole matrices (no head geometry confirmed)", unconfirmed)
    logger.info("per_head_muon: %s", tagged)
    return tagged
