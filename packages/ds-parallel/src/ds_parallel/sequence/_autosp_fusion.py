"""Fusion adapters: the vision-language boundary of a multimodal model under sequence parallelism.

Each rank holds a slice of the visual tokens (from the sharded ViT). The adapter projects them, gathers the
whole visual sequence (differentiably), splices it into the text embeddings where the model's placeholder
tokens are, pads the fused sequence to a multiple of the SP degree and returns this rank's equal slice for
the (sequence-parallel) LLM decoder. Where the placeholders go is per architecture:

- LLaVA: each image placeholder token is replaced by that image's visual tokens (the sequence grows);
- InternVL: every IMG_CONTEXT token is one visual token (same length);
- Qwen2-VL: the tokens between each vision_start / vision_end pair are the visual tokens (same length).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

import ds_comm
from ds_parallel.sequence._autosp_gather import gather_sequence, slice_lengths

__all__ = ["InternVLFusionAdapter", "LlavaFusionAdapter", "ModalityFusionSPAdapter", "Qwen2VLFusionAdapter"]

logger = logging.getLogger(__name__)

_DEFAULT_IMAGE_TOKEN_ID = -200


def _project_gather_shard(
    module: nn.Module, visual_features: torch.Tensor, text_embeds: torch.Tensor, input_ids: torch.Tensor
) -> torch.Tensor:
    group = module.process_group
    visual = module.projection(visual_features)
    full_visual = gather_sequence(visual, group, slice_lengths(visual.shape[1], group, visual.device))
    fused = module._splice_visual_into_text(text_embeds, full_visual, input_ids)
    world = module.world_size
    pad = -fused.shape[1] % world
    if pad:
        fused = F.pad(fused, (0, 0, 0, pad))
    rank = ds_comm.get_rank(group) if world > 1 else 0
    local = fused.shape[1] // world
    return fused[:, rank * local : (rank + 1) * local]


def _replace_positions(text_embeds: torch.Tensor, visual: torch.Tensor, rows: list[torch.Tensor]) -> torch.Tensor:
    """`text_embeds` with sample i's positions `rows[i]` taken, in order, from `visual[i]` (same length)."""
    samples = []
    for i, pos in enumerate(rows):
        if pos.numel() > visual.shape[1]:
            raise ValueError(
                f"sample {i} has {pos.numel()} visual placeholder positions but only {visual.shape[1]} visual tokens"
            )
        sample = text_embeds[i]
        if pos.numel():
            sample = sample.index_put((pos,), visual[i, : pos.numel()].to(sample.dtype))
        samples.append(sample)
    return torch.stack(samples)


class ModalityFusionSPAdapter(nn.Module):
    """Project the local visual tokens, splice the whole visual sequence into the text, return this rank's slice.

    forward(visual_features `[b, local_v, vit_hidden]`, text_embeds `[b, text_len, hidden]` (whole),
    input_ids `[b, text_len]`) -> `[b, ceil(fused_len / P), hidden]`. Subclasses define where the visual
    tokens go (`_splice_visual_into_text`).
    """

    def __init__(
        self, projection: nn.Module, process_group: ProcessGroup | None, image_token_id: int = _DEFAULT_IMAGE_TOKEN_ID
    ) -> None:
        super().__init__()
        self.projection = projection
        self.process_group = process_group
        self.world_size = ds_comm.get_world_size(process_group)
        self.image_token_id = image_token_id

    def forward(
        self, visual_features: torch.Tensor, text_embeds: torch.Tensor, input_ids: torch.Tensor
    ) -> torch.Tensor:
        return _project_gather_shard(self, visual_features, text_embeds, input_ids)

    def _splice_visual_into_text(
        self, text_embeds: torch.Tensor, visual_embeds: torch.Tensor, input_ids: torch.Tensor
    ) -> torch.Tensor:
        raise NotImplementedError(
            f"{type(self).__name__} does not say where the visual tokens go: use LlavaFusionAdapter, "
            f"InternVLFusionAdapter or Qwen2VLFusionAdapter, or override _splice_visual_into_text"
        )


class LlavaFusionAdapter(ModalityFusionSPAdapter):
    """LLaVA: each `image_token_id` placeholder becomes its image's visual tokens (split evenly over the
    placeholders of the sample); samples of different fused lengths are zero-padded at the end."""

    def _splice_visual_into_text(
        self, text_embeds: torch.Tensor, visual_embeds: torch.Tensor, input_ids: torch.Tensor
    ) -> torch.Tensor:
        fused = []
        for i in range(text_embeds.shape[0]):
            places = (input_ids[i] == self.image_token_id).nonzero(as_tuple=True)[0].tolist()
            if not places:
                fused.append(text_embeds[i])
                continue
            images = visual_embeds[i].chunk(len(places), dim=0)
            parts, prev = [], 0
            for pos, image in zip(places, images, strict=True):
                parts += [text_embeds[i, prev:pos], image.to(text_embeds.dtype)]
                prev = pos + 1
            parts.append(text_embeds[i, prev:])
            fused.append(torch.cat(parts, dim=0))
        longest = max(s.shape[0] for s in fused)
        return torch.stack([F.pad(s, (0, 0, 0, longest - s.shape[0])) for s in fused])


class InternVLFusionAdapter(ModalityFusionSPAdapter):
    """InternVL: each IMG_CONTEXT token (`image_token_id`) is one visual token, in order (length kept)."""

    def _splice_visual_into_text(
        self, text_embeds: torch.Tensor, visual_embeds: torch.Tensor, input_ids: torch.Tensor
    ) -> torch.Tensor:
        rows = [(ids == self.image_token_id).nonzero(as_tuple=True)[0] for ids in input_ids]
        return _replace_positions(text_embeds, visual_embeds, rows)


class Qwen2VLFusionAdapter(nn.Module):
    """Qwen2-VL: the tokens strictly between each `vision_start_token_id` / `vision_end_token_id` pair are the
    visual tokens, in order (length kept). Same forward as `ModalityFusionSPAdapter`."""

    def __init__(
        self,
        projection: nn.Module,
        process_group: ProcessGroup | None,
        vision_start_token_id: int,
        vision_end_token_id: int,
    ) -> None:
        super().__init__()
        self.projection = projection
        self.process_group = process_group
        self.world_size = ds_comm.get_world_size(process_group)
        self.vision_start_token_id = vision_start_token_id
        self.vision_end_token_id = vision_end_token_id

    def forward(
        self, visual_features: torch.Tensor, text_embeds: torch.Tensor, input_ids: torch.Tensor
    ) -> torch.Tensor:
        return _project_gather_shard(self, visual_features, text_embeds, input_ids)

    def _splice_visual_into_text(
        self, text_embeds: torch.Tensor, visual_embeds: torch.Tensor, input_ids: torch.Tensor
    ) -> torch.Tensor:
        rows = []
        for ids in input_ids:
            starts = (ids == self.vision_start_token_id).nonzero(as_tuple=True)[0].tolist()
            ends = (ids == self.vision_end_token_id).nonzero(as_tuple=True)[0].tolist()
            if len(starts) != len(ends):
                raise ValueError(
                    f"Qwen2VLFusionAdapter: {len(starts)} vision_start tokens but {len(ends)} vision_end tokens"
                )
            inner = [p for s, e in zip(starts, ends, strict=True) for p in range(s + 1, e)]
            rows.append(torch.tensor(inner, dtype=torch.long, device=text_embeds.device))
        return _replace_positions(text_embeds, visual_embeds, rows)
