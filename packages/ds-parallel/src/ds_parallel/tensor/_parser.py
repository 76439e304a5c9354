"""Which blocks of a model AutoTP shards, and which of their linear layers are row-parallel.

DeepSpeed's automatic policy, from the module tree alone: the blocks are the distinct layer types held
in `nn.ModuleList`s; inside a block, a linear layer is row-parallel (its output is all-reduced) when it
is the last linear before a LayerNorm (cyclically: a block that starts with its norms ends with its
row-parallel layer) or when its name says it projects back to the model width (`o_proj`, `out_proj`,
`down_proj`, and a few model-specific names). Every other linear layer is column-parallel.
"""

from __future__ import annotations

import dataclasses
import re

from torch import nn

__all__ = ["UNSUPPORTED_FAMILIES", "BlockPolicy", "block_modules", "find_block_policies", "model_family"]

#: Model families DeepSpeed's AutoTP refuses (GPT-2 keeps its projections in `Conv1D`, the others have
#: attention layouts the automatic policy gets wrong); DeepSpeed points them at kernel injection.
UNSUPPORTED_FAMILIES = ("deberta", "flaubert", "fsmt", "gpt2", "led", "longformer", "xlm", "xlnet")
_NORM_KEYS = ("LayerNorm", "layer_norm", "ln_1", "ln_2")
_NESTED_NORM_KEYS = ("LayerNorm", "layer_norm")
_NORM = "ln"


@dataclasses.dataclass(frozen=True)
class BlockPolicy:
    """One block type and the names (as `parent.leaf` inside the block) of its row-parallel layers."""

    block_type: type[nn.Module]
    row_parallel: frozenset[str]


def model_family(model: nn.Module) -> str:
    """The model's family as DeepSpeed reads it: the prefix of the first `...Model` class in the tree."""
    for _, module in model.named_modules():
        match = re.match(r"(\w*?)(Model|Stack)$", type(module).__name__)
        if match and module is not model:
            return match.group(1).lower()
    match = re.match(r"(\w*?)Model", type(model).__name__)
    return (match.group(1) if match else type(model).__name__).lower()


def block_modules(model: nn.Module) -> list[nn.Module]:
    """One instance of every distinct layer type held in an `nn.ModuleList`, in tree order (the blocks)."""
    found: list[nn.Module] = []
    seen: set[str] = set()

    def walk(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, nn.ModuleList):
                for item in child.children():
                    if type(item).__name__ not in seen:
                        seen.add(type(item).__name__)
                        found.append(item)
            else:
                walk(child)

    walk(model)
    return found


def _nested_layers(parent: str, module: nn.Module) -> list[str]:
    out: list[str] = []
    for key, sub in module._modules.items():
        if isinstance(sub, nn.Linear):
            out.append(f"{parent}.{key}")
        elif isinstance(sub, nn.LayerNorm) or key in _NESTED_NORM_KEYS:
            out.append(_NORM)
        elif sub is not None:
            out.extend(_nested_layers(key, sub))
    return out


def _block_layers(block: nn.Module) -> list[str]:
    out: list[str] = []
    for key, sub in block._modules.items():
        if isinstance(sub, nn.Linear):
            out.append(f".{key}")
        elif isinstance(sub, nn.LayerNorm) or key in _NORM_KEYS:
            out.append(_NORM)
        elif sub is not None:
            out.extend(_nested_layers(key, sub))
    return out


def _named_row_parallel(layer: str, block: nn.Module, model_classes: str) -> bool:
    block_path = f"{type(block).__module__}.{type(block).__name__}"
    return (
        any(key in layer for key in ("out_proj", "o_proj", "down_proj"))
        or ("attention.dense" in layer and "GPTNeoX" in model_classes)
        or ("self_attention.dense" in layer and "falcon" in block_path)
        or ("w2" in layer and "Mixtral" in block_path)
        or ("self_attn.dense" in layer and "Phi" in block_path)
        or ("self_attention.dense" in layer and "ChatGLM" in model_classes)
        or ("dense_4h_to_h" in layer and "ChatGLM" in model_classes)
    )


def find_block_policies(model: nn.Module) -> list[BlockPolicy]:
    """The blocks to shard and their row-parallel layers.

    Raises:
        ValueError: the model's family is one AutoTP does not shard, or no block has a layer that
            could end a tensor-parallel region (nothing to shard).
    """
    family = model_family(model)
    if family in UNSUPPORTED_FAMILIES:
        raise ValueError(
            f"AutoTP does not support {family} models ({type(model).__name__}): DeepSpeed's automatic tensor "
            "parallelism refuses this family too (use a model with nn.Linear projections, e.g. Llama, OPT, Qwen2)"
        )
    blocks = block_modules(model)
    model_classes = " ".join(type(m).__name__ for m in model.modules())
    policies: list[BlockPolicy] = []
    for block in blocks:
        layers = _block_layers(block)
        rows: set[str] = set()
        for i, layer in enumerate(layers):
            if layer == _NORM:
                if layers[i - 1] != _NORM:
                    rows.add(layers[i - 1])
            elif _named_row_parallel(layer, block, model_classes):
                rows.add(layer)
        if rows:
            policies.append(BlockPolicy(type(block), frozenset(rows)))
    if not policies:
        listed = ", ".join(type(b).__name__ for b in blocks) or "none (no nn.ModuleList of layers)"
        raise ValueError(
            f"AutoTP cannot shard {type(model).__name__}: no block has a linear layer that ends a tensor-parallel "
            f"region (a projection named o_proj/out_proj/down_proj or followed by a LayerNorm); blocks found: {listed}"
        )
    return policies
