"""AutoSP on one process (no process group: SP=1): detection, refusals, and the InternVL / Qwen2-VL / LLaVA splices
against hand-built fused sequences. The SP=2 equivalence runs in tests/dist/test_autosp_dist.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ds_parallel.sequence import (
    InternVLFusionAdapter,
    LlavaFusionAdapter,
    ModalityFusionSPAdapter,
    Qwen2VLFusionAdapter,
    auto_wrap_model_for_sp,
    detect_model_sp_info,
)


class ViTAttention(nn.Module):  # named as Hugging Face's, so the detector recognises it
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class LlamaAttention(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _model() -> nn.Module:
    return nn.ModuleDict(
        {"vision": nn.ModuleList([ViTAttention()]), "mm_projector": nn.Linear(4, 4), "lm": LlamaAttention()}
    )


def test_detect_and_wrap() -> None:
    model = _model()
    info = detect_model_sp_info(model)
    assert [n for n, _ in info.vit_attn_modules] == ["vision.0"]
    assert [n for n, _ in info.llm_attn_modules] == ["lm"]
    assert info.vision_projection_module is not None and info.vision_projection_module[0] == "mm_projector"
    auto_wrap_model_for_sp(model, None)
    assert type(model["vision"][0]).__name__ == "UlyssesSPViTAttention" and isinstance(model["lm"], LlamaAttention)
    with pytest.raises(ValueError, match="_VIT_ATTN_CLASSNAMES"):
        auto_wrap_model_for_sp(nn.Linear(2, 2), None)


def test_splices_match_hand_built_sequences() -> None:
    gen = torch.Generator().manual_seed(0)
    text = torch.randn(1, 8, 4, generator=gen, dtype=torch.float64)
    visual = torch.randn(1, 3, 4, generator=gen, dtype=torch.float64)
    ident = nn.Identity()
    # InternVL: three IMG_CONTEXT tokens (id 7) are the three visual tokens, in order.
    ids = torch.tensor([[1, 2, 7, 7, 7, 3, 4, 5]])
    want = text.clone()
    want[0, 2:5] = visual[0]
    torch.testing.assert_close(InternVLFusionAdapter(ident, None, image_token_id=7)(visual, text, ids), want)
    # Qwen2-VL: the tokens between vision_start (8) and vision_end (9).
    ids = torch.tensor([[1, 8, 0, 0, 0, 9, 4, 5]])
    want = text.clone()
    want[0, 2:5] = visual[0]
    torch.testing.assert_close(Qwen2VLFusionAdapter(ident, None, 8, 9)(visual, text, ids), want)
    # LLaVA: the placeholder becomes the three visual tokens (8 - 1 + 3 = 10 tokens).
    ids = torch.tensor([[1, 2, -200, 3, 4, 5, 6, 0]])
    want = torch.cat([text[:, :2], visual, text[:, 3:]], dim=1)
    torch.testing.assert_close(LlavaFusionAdapter(ident, None)(visual, text, ids), want)
    with pytest.raises(NotImplementedError, match="LlavaFusionAdapter"):
        ModalityFusionSPAdapter(ident, None)(visual, text, ids)
