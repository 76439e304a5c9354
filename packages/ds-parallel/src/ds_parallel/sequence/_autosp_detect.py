"""Which modules of a multimodal model AutoSP wraps: attention classes by name, the vision-language projection.

A model's ViT encoder attention (non-causal, over image patches) and its LLM decoder attention are found by
their Hugging Face class names; the projection between them by the attribute names multimodal models use.
To cover another architecture, add its attention class name to `_VIT_ATTN_CLASSNAMES` (with its CLS-token
flag in `_VIT_HAS_CLS_TOKEN`) or `_LLM_ATTN_CLASSNAMES`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from torch import nn

__all__ = ["SPModelInfo", "detect_model_sp_info"]

logger = logging.getLogger(__name__)

_VIT_ATTN_CLASSNAMES = {
    "ViTAttention",
    "CLIPAttention",
    "SiglipAttention",
    "InternVisionAttention",
    "Qwen2VLVisionAttention",
    "Idefics2VisionAttention",
    "PaliGemmaVisionAttention",
}

#: Whether the ViT puts a CLS token first (kept whole on every rank, not sharded); unknown classes: True.
_VIT_HAS_CLS_TOKEN = {
    "ViTAttention": True,
    "CLIPAttention": True,
    "SiglipAttention": False,
    "InternVisionAttention": False,
    "Qwen2VLVisionAttention": False,
    "Idefics2VisionAttention": False,
    "PaliGemmaVisionAttention": False,
}

_LLM_ATTN_CLASSNAMES = {
    "LlamaAttention",
    "MistralAttention",
    "Qwen2Attention",
    "InternLM2Attention",
    "GemmaAttention",
    "Phi3Attention",
    "GPTNeoXAttention",
    "FalconAttention",
    "MptAttention",
}

_VISION_PROJ_KEYWORDS = ("visual_projection", "mm_projector", "vision_proj", "multi_modal_projector", "img_projection")


@dataclass
class SPModelInfo:
    """What `detect_model_sp_info` found: `(dotted name, module)` pairs, the outermost projection or None."""

    vit_attn_modules: list[tuple[str, nn.Module]] = field(default_factory=list)
    llm_attn_modules: list[tuple[str, nn.Module]] = field(default_factory=list)
    vision_projection_module: tuple[str, nn.Module] | None = None


def detect_model_sp_info(model: nn.Module) -> SPModelInfo:
    """Scan `model` for ViT attention, LLM attention and the vision-language projection (first match)."""
    info = SPModelInfo()
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind in _VIT_ATTN_CLASSNAMES:
            info.vit_attn_modules.append((name, module))
        elif kind in _LLM_ATTN_CLASSNAMES:
            info.llm_attn_modules.append((name, module))
        if info.vision_projection_module is None and any(key in name for key in _VISION_PROJ_KEYWORDS):
            info.vision_projection_module = (name, module)
    return info
