"""Which module a partition_config (`AutoTPConfig`) cuts, and by which spec: the config resolved against a model.

The model is walked from the root. A module holding a 2-D `weight` (an `nn.Linear`, or a linear-like
module of the user's) is decided by the first spec matching `<path>.weight` and is not entered; any
other module is entered. Embeddings stay whole whatever the specs say (ds does not cut vocabularies,
DeepSpeed's own fallback when it cannot). Everything is checked before any module is touched: a layer
no spec matches under `strict_mode`, or a cut of a weight shared with another module, is a
`ValueError` naming the layer and the spec's patterns. A gathered column cut of a weight tied to an
embedding leaves both whole, as DeepSpeed does.
"""

from __future__ import annotations

import dataclasses
import logging

from torch import nn

from ds_parallel.tensor._partition_config import AutoTPConfig, PartitionType, TPLayerSpec, model_type_of
from ds_parallel.tensor._plan import _weight_2d, weight_owners

__all__ = ["ResolvedSpecs", "resolve_specs"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ResolvedSpecs:
    """A partition config applied to one model."""

    layers: dict[str, TPLayerSpec]
    """Module path -> the (column or row) spec that cuts it, in tree order."""
    grad_allreduce: tuple[str, ...]
    """Names of the parameters kept whole whose gradients are summed over the group."""


def resolve_specs(model: nn.Module, config: AutoTPConfig, *, skip: tuple[type, ...] = ()) -> ResolvedSpecs:
    """Resolve `config` against `model` (module paths as `model.named_modules()` gives them); no side effects.

    Args:
        model: the model to shard.
        config: the specs (`partition_config_from_settings`).
        skip: module types already tensor-parallel (left as they are).

    Raises:
        ValueError: an unmatched layer under `strict_mode`, or a cut of a weight another module shares.
    """
    model_type = model_type_of(model)
    owners = weight_owners(model)
    layers: dict[str, TPLayerSpec] = {}

    def decide(path: str, module: nn.Module) -> None:
        spec = config.find_matching_spec(f"{path}.weight", model_type)
        if spec is None:
            if config.strict_mode:
                raise ValueError(
                    f"AutoTP: no tensor_parallel.partition_config layer spec matches {path + '.weight'!r} "
                    f"({type(module).__name__}) and strict_mode is on; add a spec for it (partition_type 'skip' "
                    "keeps it whole)"
                )
            return
        if spec.partition_type is PartitionType.SKIP:
            return
        shared = [n for n in owners.get(id(module.weight), []) if n != path]
        if shared:
            if spec.gather_output and any(isinstance(model.get_submodule(n), nn.Embedding) for n in shared):
                logger.warning("AutoTP: %r.weight is tied to %s; leaving both whole to keep the tie", path, shared)
                return
            raise ValueError(
                f"AutoTP: the partition_config spec {spec.patterns} cuts {path!r} ({spec.partition_type.value}), "
                f"but its weight is shared with {shared}; cutting it would break the tie"
            )
        layers[path] = spec

    def walk(module: nn.Module, prefix: str) -> None:
        for key, child in module.named_children():
            path = f"{prefix}.{key}" if prefix else key
            if (skip and isinstance(child, skip)) or isinstance(child, nn.Embedding):
                continue
            if isinstance(getattr(child, "weight", None), nn.Parameter) and _weight_2d(child):
                decide(path, child)
            else:
                walk(child, path)

    walk(model, "")
    grads = tuple(
        name
        for name, _ in model.named_parameters()
        if (spec := config.find_matching_spec(name, model_type)) is not None and spec.grad_allreduce
    )
    return ResolvedSpecs(layers, grads)
