"""ALST on a tiny Hugging Face Llama: sequence-sharded forward/backward equals the unsharded model.

Each SP group runs its ranks' samples through the adapter; each rank computes its shard's loss from
`shift_labels` (the adapter's batches carry no `labels`), the shards' losses are combined weighted by their
real targets, and for every sample the combined loss equals the full-sequence loss and the SP group's summed
gradients / SP equal the full-sequence gradients (fp32, 1e-5). The model is loaded with the core attention's
own name (DeepSpeed's way) or ds's "ulysses". Needs `transformers` (skipped without it).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ds_comm.testing import run_ranks

pytest.importorskip("transformers")

SEQ, VOCAB = 16, 64


def tiny_llama_config(kv_heads: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )


def sample(index: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + index)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=gen)
    return {"input_ids": ids, "labels": ids.clone()}


def build(config: Any, attn: str) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)


def shard_loss(model: Any, mb: dict[str, Any]) -> torch.Tensor:
    """This shard's mean loss over its pre-shifted targets (the model itself computes none without labels)."""
    out = model(**mb, use_cache=False)
    assert out.loss is None
    return model.loss_function(
        logits=out.logits, labels=None, shift_labels=mb["shift_labels"], vocab_size=model.config.vocab_size
    )


def _sharded(rank: int, world: int, core: str, kv_heads: int, load_as: str, registrations: int) -> list[dict[str, Any]]:
    import torch.distributed as dist

    from ds_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter, aggregate_sp_loss

    config = tiny_llama_config(kv_heads)
    for _ in range(registrations):  # registering again wraps the core again, not the first wrapper
        mpu = UlyssesSPAttentionHF.register_with_transformers(
            config, core, sequence_parallel_size=world, micro_batch_size=1, seq_length=SEQ
        )
    group, sp_rank = mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_rank()
    model = build(config, load_as)
    adapter = UlyssesSPDataLoaderAdapter([sample(rank)], sp_rank, group, world, "cpu")
    assert len(adapter) == world
    out = []
    for mb in adapter:
        assert mb["input_ids"].shape == (1, SEQ // world)
        model.zero_grad()
        loss = aggregate_sp_loss(shard_loss(model, mb), mb["shift_labels"], group)
        loss.backward()
        grads = {}
        for name, p in model.named_parameters():
            g = p.grad.clone()
            dist.all_reduce(g, group=group)
            grads[name] = g / world
        out.append({"loss": loss.item(), "grads": grads})
    return out


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    ("world", "core", "kv_heads", "load_as", "registrations"),
    [
        (2, "sdpa", 2, "sdpa", 1),
        (2, "eager", 2, "eager", 1),
        (4, "sdpa", 4, "ulysses", 1),
        (2, "sdpa", 1, "sdpa", 2),  # fewer kv heads than ranks: the kv head is replicated to both
        (4, "sdpa", 2, "ulysses", 1),
    ],
)
def test_sharded_model_matches_full_sequence(
    world: int, core: str, kv_heads: int, load_as: str, registrations: int
) -> None:
    results = run_ranks(world, _sharded, core, kv_heads, load_as, registrations, timeout_s=300)
    config = tiny_llama_config(kv_heads)
    ref = build(config, "sdpa" if core == "sdpa" else "eager")
    for index in range(world):  # the adapter processes the SP group's samples in rank order
        ref.zero_grad()
        loss = ref(**sample(index), use_cache=False).loss
        loss.backward()
        for rank in range(world):
            got = results[rank][index]
            assert abs(got["loss"] - loss.item()) < 1e-5, (index, rank, got["loss"], loss.item())
            for name, p in ref.named_parameters():
                torch.testing.assert_close(
                    got["grads"][name],
                    p.grad,
                    atol=1e-5,
                    rtol=1e-5,
                    msg=lambda m, n=name, i=index, r=rank: f"sample {i} rank {r} {n}: {m}",
                )


def _positions_seen(rank: int, world: int) -> list[list[int]]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import AttentionInterface

    from ds_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter

    seen: list[list[int]] = []

    def probe(module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, **kwargs: Any) -> Any:
        seen.append(kwargs["position_ids"].reshape(-1).tolist())
        return sdpa_attention_forward(module, q, k, v, mask, **kwargs)

    AttentionInterface.register("probe_core", probe)
    config = tiny_llama_config(2)
    mpu = UlyssesSPAttentionHF.register_with_transformers(config, "probe_core", sequence_parallel_size=world)
    model = build(config, "ulysses")
    batch = {**sample(0), "position_ids": torch.arange(SEQ).view(1, SEQ) + 5}
    mb = next(
        iter(
            UlyssesSPDataLoaderAdapter(
                [batch], mpu.get_sequence_parallel_rank(), mpu.get_sequence_parallel_group(), world, "cpu"
            )
        )
    )
    model(**mb, use_cache=False)
    return seen


def test_core_attention_sees_whole_sequence_positions() -> None:
    """A core that reads position_ids (flash attention's packed-sample detection) gets the whole sequence's."""
    for seen in run_ranks(2, _positions_seen, timeout_s=120):
        assert seen == [list(range(5, 5 + SEQ))] * 2  # one call per layer


def _flex_losses(rank: int, world: int) -> list[float]:
    from ds_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter, aggregate_sp_loss

    config = tiny_llama_config(2)
    mpu = UlyssesSPAttentionHF.register_with_transformers(config, "flex_attention", sequence_parallel_size=world)
    group = mpu.get_sequence_parallel_group()
    model = build(config, "flex_attention")
    adapter = UlyssesSPDataLoaderAdapter([sample(rank)], mpu.get_sequence_parallel_rank(), group, world, "cpu")
    with torch.no_grad():  # flex attention has no backward on the CPU
        return [aggregate_sp_loss(shard_loss(model, mb), mb["shift_labels"], group).item() for mb in adapter]


@pytest.mark.timeout(1000)
def test_flex_attention_core_is_causal_over_the_whole_sequence() -> None:
    """The shard's block mask is replaced by a causal one of the whole sequence (no mask would be bidirectional)."""
    results = run_ranks(2, _flex_losses, timeout_s=900)
    ref = build(tiny_llama_config(2), "sdpa")
    with torch.no_grad():
        for index in range(2):
            want = ref(**sample(index), use_cache=False).loss.item()
            for rank, got in enumerate(results):
                assert abs(got[index] - want) < 1e-5, (index, rank, got[index], want)
