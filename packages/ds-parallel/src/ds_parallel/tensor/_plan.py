"""Which module a Hugging Face tensor-parallel plan cuts, and how: the plan resolved against a model.

A plan maps module-path patterns to styles. As in DeepSpeed 0.19.8, a pattern `p` matches a module
whose path, followed by `.weight`, matches the regex `.*p` (`*` standing for any text, other
characters literal) up to the end; the first matching entry in plan order wins. The model is walked
from the root: a module holding a 2-D `weight` is decided by its entry (no entry: it stays whole) and
is not entered; any other module is entered.

The styles DeepSpeed supports (`PLAN_STYLES`, case-insensitive):

* `colwise`: column-parallel (output features cut; the output stays sharded);
* `colwise_gather_output` (and its older name `colwise_rep`): column-parallel, the output gathered
  back to full width on every rank;
* `rowwise`: row-parallel (input features cut, the partial outputs summed);
* `replicated_with_grad_allreduce`: the parameter stays whole on every rank, its gradient is summed
  over the group (a norm applied to the local heads, Qwen3's `q_norm`, gets a partial gradient);
* `embedding_rowwise`: the embedding stays whole (DeepSpeed would cut a tied embedding and head by
  vocabulary, which ds does not implement; that is DeepSpeed's own fallback when it cannot).

Everything is checked before any module is touched: a style outside this list, a cut of something
that is not an `nn.Linear`, or a cut of a weight shared with another module is a `ValueError` naming
the module (or the pattern) and the style. A gathered head whose weight is tied to an embedding stays
whole, as DeepSpeed leaves it.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import re
from collections.abc import Mapping

from torch import nn

__all__ = [
    "PLAN_STYLES",
    "PlanStyle",
    "ResolvedPlan",
    "plan_pattern",
    "plan_regex",
    "plan_wildcard_regex",
    "resolve_plan",
]

logger = logging.getLogger(__name__)


class PlanStyle(enum.Enum):
    """What a plan entry does to the modules it matches."""

    COLUMN = "column"
    COLUMN_GATHER = "column_gather"
    ROW = "row"
    REPLICATED_GRAD_ALLREDUCE = "replicated_grad_allreduce"
    KEEP = "keep"

    @property
    def cuts(self) -> bool:
        """The module's weight is cut across the ranks."""
        return self in (PlanStyle.COLUMN, PlanStyle.COLUMN_GATHER, PlanStyle.ROW)


#: Hugging Face plan styles DeepSpeed 0.19.8's AutoTP training accepts, and what each does here.
PLAN_STYLES: Mapping[str, PlanStyle] = {
    "colwise": PlanStyle.COLUMN,
    "colwise_rep": PlanStyle.COLUMN_GATHER,
    "colwise_gather_output": PlanStyle.COLUMN_GATHER,
    "rowwise": PlanStyle.ROW,
    "replicated_with_grad_allreduce": PlanStyle.REPLICATED_GRAD_ALLREDUCE,
    "embedding_rowwise": PlanStyle.KEEP,
}


def plan_wildcard_regex(pattern: str) -> str:
    r"""A plan pattern as regex text, without the `.weight` anchor: `.*` + the pattern with `*` standing for
    any text and every other character literal (`"layers.*.q_proj"` -> `r".*layers\..*\.q_proj"`)."""
    return ".*" + re.escape(pattern).replace(r"\*", ".*")


def plan_regex(pattern: str) -> str:
    """The regex text a plan pattern stands for, matched (with `re.match`) against `<module path>.weight`."""
    suffix = "$" if pattern.endswith(".weight") else r"\.weight$"
    return plan_wildcard_regex(pattern) + suffix


def plan_pattern(pattern: str) -> re.Pattern[str]:
    """`plan_regex(pattern)` compiled."""
    return re.compile(plan_regex(pattern))


@dataclasses.dataclass(frozen=True)
class ResolvedPlan:
    """A plan applied to one model: the modules it cuts, and the parameters whose gradients it sums."""

    layers: dict[str, PlanStyle]
    """Module path -> COLUMN / COLUMN_GATHER / ROW, in tree order (each an `nn.Linear` today)."""
    grad_allreduce: tuple[str, ...]
    """Names of the parameters kept whole whose gradients are summed over the group."""


def weight_owners(model: nn.Module) -> dict[int, list[str]]:
    """id of each `weight` parameter -> the paths of every module holding it (tied weights have several)."""
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        weight = getattr(module, "weight", None)
        if isinstance(weight, nn.Parameter):
            owners.setdefault(id(weight), []).append(name)
    return owners


def _weight_2d(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return weight is not None and getattr(weight, "dim", lambda: 0)() == 2


def _match(compiled: list[tuple[str, str, re.Pattern[str]]], name: str) -> tuple[str, str] | None:
    for pattern, style, regex in compiled:
        if regex.match(name):
            return pattern, style
    return None


def resolve_plan(model: nn.Module, plan: Mapping[str, str], *, skip: tuple[type, ...] = ()) -> ResolvedPlan:
    """Resolve `plan` against `model` (module paths as `model.named_modules()` gives them); no side effects.

    Args:
        model: the model to shard.
        plan: pattern -> style, as `extract_hf_tp_plan` returns it.
        skip: module types already tensor-parallel (left as they are).

    Raises:
        ValueError: a style outside `PLAN_STYLES`, a cut (colwise/rowwise) of a module that is not an
            `nn.Linear`, or of a weight another module shares; the message names the module (or the
            pattern, when it matches none) and the style.
    """
    compiled = [(p, s, plan_pattern(p)) for p, s in plan.items()]
    for pattern, style, regex in compiled:
        if not isinstance(style, str) or style.lower() not in PLAN_STYLES:
            hits = [n for n, m in model.named_modules() if n and regex.match(f"{n}.weight")]
            where = f"module {hits[0]!r}" if hits else "no module of the model"
            raise ValueError(
                f"AutoTP: the Hugging Face tp_plan entry {pattern!r} (matching {where}) has style {style!r}, which "
                f"AutoTP does not support (supported: {', '.join(PLAN_STYLES)}); the plan is refused as a whole"
            )
    owners = weight_owners(model)

    layers: dict[str, PlanStyle] = {}

    def walk(module: nn.Module, prefix: str) -> None:
        for key, child in module.named_children():
            path = f"{prefix}.{key}" if prefix else key
            if skip and isinstance(child, skip):
                continue
            if not (isinstance(child, nn.Embedding) or _weight_2d(child)):
                walk(child, path)
                continue
            hit = _match(compiled, f"{path}.weight")
            if hit is None:
                continue
            style = PLAN_STYLES[hit[1].lower()]
            if not style.cuts:
                continue
            if not isinstance(child, nn.Linear):
                raise ValueError(
                    f"AutoTP: the Hugging Face tp_plan cuts {path!r} ({type(child).__name__}) with style {hit[1]!r} "
                    f"(entry {hit[0]!r}); ds cuts only nn.Linear layers by a plan"
                )
            shared = [n for n in owners.get(id(child.weight), []) if n != path]
            if shared:
                if style is PlanStyle.COLUMN_GATHER and any(
                    isinstance(model.get_submodule(n), nn.Embedding) for n in shared
                ):
                    logger.warning(
                        "AutoTP: %r.weight is tied to %s; leaving both whole to keep the tie (gathered output)",
                        path,
                        shared,
                    )
                    continue
                raise ValueError(
                    f"AutoTP: the Hugging Face tp_plan cuts {path!r} with style {hit[1]!r} (entry {hit[0]!r}), but "
                    f"its weight is shared with {shared}; cutting it would break the tie"
                )
            layers[path] = style

    walk(model, "")
    grads = tuple(
        name
        for name, _ in model.named_parameters()
        if (hit := _match(compiled, name)) is not None
        and PLAN_STYLES[hit[1].lower()] is PlanStyle.REPLICATED_GRAD_ALLREDUCE
    )
    return ResolvedPlan(layers, grads)
