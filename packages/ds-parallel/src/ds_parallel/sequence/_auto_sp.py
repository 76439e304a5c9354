"""`auto_wrap_model_for_sp`: sequence parallelism for a multimodal model's ViT encoder in one call.

Every recognised ViT attention module is replaced (in place) by `UlyssesSPViTAttention` around it. LLM
decoder attention in the Hugging Face `hidden_states` interface is reported, not wrapped: it needs ALST
(`ds_parallel.ulysses_sp.UlyssesSPAttentionHF`), which takes the model's config and sequence length. The
vision-language projection is reported too: wrap it with the fusion adapter of the architecture.
"""

from __future__ import annotations

import logging

from torch import nn
from torch.distributed import ProcessGroup

from ds_parallel.sequence._autosp_detect import _VIT_HAS_CLS_TOKEN, detect_model_sp_info
from ds_parallel.sequence._autosp_vit import UlyssesSPViTAttention

__all__ = ["auto_wrap_model_for_sp"]

logger = logging.getLogger(__name__)


def _set_module_by_name(model: nn.Module, dotted_name: str, new_module: nn.Module) -> None:
    parent_name, _, leaf = dotted_name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, leaf, new_module)


def auto_wrap_model_for_sp(model: nn.Module, process_group: ProcessGroup | None) -> nn.Module:
    """Wrap `model`'s ViT attention for sequence parallelism over `process_group`; returns `model` (changed in place).

    Raises:
        ValueError: no attention module of a known class was found (the message says how to register one).
    """
    info = detect_model_sp_info(model)
    if not info.vit_attn_modules and not info.llm_attn_modules:
        raise ValueError(
            f"auto_wrap_model_for_sp: {type(model).__name__} has no attention module of a known class; add its "
            f"attention class name to _VIT_ATTN_CLASSNAMES or _LLM_ATTN_CLASSNAMES "
            f"(ds_parallel.sequence._autosp_detect, deepspeed.sequence.autosp_detector)"
        )
    for name, module in info.vit_attn_modules:
        has_cls = _VIT_HAS_CLS_TOKEN.get(type(module).__name__, True)
        _set_module_by_name(model, name, UlyssesSPViTAttention(module, process_group, has_cls_token=has_cls))
        logger.debug("AutoSP: %s wrapped in UlyssesSPViTAttention (CLS token: %s)", name, has_cls)
    logger.info("AutoSP: wrapped %d ViT attention module(s)", len(info.vit_attn_modules))
    for name, module in info.llm_attn_modules:
        logger.warning(
            "AutoSP: LLM attention %s (%s) takes hidden_states, not q/k/v: not wrapped; give the decoder sequence "
            "parallelism with UlyssesSPAttentionHF.register_with_transformers",
            name,
            type(module).__name__,
        )
    if info.vision_projection_module is not None:
        logger.warning(
            "AutoSP: vision projection %s found; wrap it with the model's fusion adapter (LlavaFusionAdapter, "
            "InternVLFusionAdapter, Qwen2VLFusionAdapter) for the cross-modal gather and re-shard",
            info.vision_projection_module[0],
        )
    return model
