"""AutoSP at SP=2 (2 gloo ranks) equals the unsharded model: outputs and gradients to 1e-5 (float64).

Two tiny models built from configs (nothing downloaded): a Hugging Face ViT (25 patches: uneven 13 | 12
slices, with a CLS token) and a LLaVA-style model (CLIP vision tower, `mm_projector`, token embedding and
LM head) whose fused sequence goes through `LlavaFusionAdapter`. Each rank's loss covers its own tokens
(the replicated CLS output counted on rank 0 only), so the ranks' summed parameter gradients must equal the
unsharded model's.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ds_comm.testing import run_ranks

TOL = {"atol": 1e-5, "rtol": 1e-5}
IMAGE_TOKEN = -200


def _shard_hook(rank: int, lengths: list[int]) -> Any:
    """A forward hook for a ViT's embeddings: keep CLS and this rank's patch slice."""
    start = sum(lengths[:rank])

    def hook(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        return torch.cat([out[:, :1], out[:, 1 + start : 1 + start + lengths[rank]]], dim=1)

    return hook


def _summed_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    import torch.distributed as dist

    out = {}
    for name, p in model.named_parameters():
        g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g)
        out[name.replace(".attn.", ".")] = g  # the wrapper adds `.attn` inside the wrapped attention
    return out


def _case(rank: int, world: int) -> dict[str, float]:
    import torch.distributed as dist
    from transformers import CLIPVisionConfig, CLIPVisionModel, ViTConfig, ViTModel

    from ds_parallel.sequence import LlavaFusionAdapter, UlyssesSPViTAttention, auto_wrap_model_for_sp

    group = dist.group.WORLD
    errs: dict[str, float] = {}

    def close(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"rank {rank} {name}: {m}")
        errs[name] = float((got - want).detach().abs().max())

    # --- ViT: 10x10 image, patch 2 -> 25 patches (13 | 12), CLS first.
    torch.manual_seed(0)
    cfg = ViTConfig(
        image_size=10,
        patch_size=2,
        num_channels=3,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    ref = ViTModel(cfg, add_pooling_layer=False).double()
    sp = copy.deepcopy(ref)
    auto_wrap_model_for_sp(sp, group)
    assert sum(isinstance(m, UlyssesSPViTAttention) for m in sp.modules()) == 2
    gen = torch.Generator().manual_seed(1)
    pixels = torch.randn(2, 3, 10, 10, generator=gen, dtype=torch.float64)
    lengths = [13, 12]
    sp.embeddings.register_forward_hook(_shard_hook(rank, lengths))
    out = sp(pixel_values=pixels).last_hidden_state
    want = ref(pixel_values=pixels).last_hidden_state
    start = 1 + sum(lengths[:rank])
    mine = torch.cat([want[:, :1], want[:, start : start + lengths[rank]]], dim=1)
    close("vit out", out, mine.detach())
    weight = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    w_mine = torch.cat([weight[:, :1] * (rank == 0), weight[:, start : start + lengths[rank]]], dim=1)
    (out * w_mine).sum().backward()
    (want * weight).sum().backward()
    grads = _summed_grads(sp)
    for name, p in ref.named_parameters():
        close(f"vit grad {name}", grads[name], p.grad)

    # --- LLaVA-style: CLIP tower (8x8 image, patch 2 -> 16 patches, 8 | 8), projector, splice, LM head.
    torch.manual_seed(2)
    vcfg = CLIPVisionConfig(
        image_size=8, patch_size=2, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2
    )
    vocab, hidden = 23, 12
    ref_parts = nn.ModuleDict(
        {
            "vision_tower": CLIPVisionModel(vcfg),
            "mm_projector": nn.Sequential(nn.Linear(16, hidden), nn.GELU(), nn.Linear(hidden, hidden)),
            "embed": nn.Embedding(vocab, hidden),
            "head": nn.Linear(hidden, vocab),
        }
    ).double()
    sp_parts = copy.deepcopy(ref_parts)
    auto_wrap_model_for_sp(sp_parts, group)
    adapter = LlavaFusionAdapter(sp_parts["mm_projector"], group, image_token_id=IMAGE_TOKEN)
    pixels = torch.randn(2, 3, 8, 8, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, vocab, (2, 10), generator=gen)
    ids[0, 2] = IMAGE_TOKEN
    ids[1, 6] = IMAGE_TOKEN
    v_lengths = [8, 8]
    sp_parts["vision_tower"].embeddings.register_forward_hook(_shard_hook(rank, v_lengths))
    visual = sp_parts["vision_tower"](pixel_values=pixels).last_hidden_state[:, 1:]
    local = adapter(visual, sp_parts["embed"](ids.clamp(min=0)), ids)
    logits = sp_parts["head"](local)

    full_visual = ref_parts["mm_projector"](ref_parts["vision_tower"](pixel_values=pixels).last_hidden_state[:, 1:])
    text = ref_parts["embed"](ids.clamp(min=0))
    fused = []
    for i in range(2):
        pos = int((ids[i] == IMAGE_TOKEN).nonzero()[0])
        fused.append(torch.cat([text[i, :pos], full_visual[i], text[i, pos + 1 :]]))
    fused = torch.nn.functional.pad(torch.stack(fused), (0, 0, 0, 1))  # 25 -> 26: a multiple of 2
    ref_logits = ref_parts["head"](fused)
    half = ref_logits.shape[1] // 2
    close("llava logits", logits, ref_logits[:, rank * half : (rank + 1) * half].detach())
    weight = torch.randn(ref_logits.shape, generator=gen, dtype=torch.float64)
    (logits * weight[:, rank * half : (rank + 1) * half]).sum().backward()
    (ref_logits * weight).sum().backward()
    grads = _summed_grads(sp_parts)
    for name, p in ref_parts.named_parameters():
        close(f"llava grad {name}", grads[name], p.grad if p.grad is not None else torch.zeros_like(p))
    return errs


def test_autosp_vit_and_llava_sp2_match_unsharded() -> None:
    results = run_ranks(2, _case, timeout_s=180)
    assert all(len(r) > 20 for r in results), results
    assert max(max(r.values()) for r in results) <= 1e-5
