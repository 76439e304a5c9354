"""`deepspeed.runtime.rollout`: the interface's shape checks, the factory, and `HybridEngineRollout` generating
with a hybrid engine over a tiny Hugging Face model, checked against the model's own `generate` (same prompts,
same seed): greedy and sampled tokens, `n_samples_per_prompt` expansion, padding after the first eos."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from ds_engine_testkit import base_config, make_engine

from ds_engine.runtime.rollout import (
    HybridEngineRollout,
    HybridEngineRolloutConfig,
    RolloutBatch,
    RolloutConfig,
    RolloutEngine,
    RolloutRequest,
    SamplingConfig,
    build_rollout,
)


def test_request_and_batch_check_their_shapes() -> None:
    with pytest.raises(ValueError, match="must be 2-D"):
        RolloutRequest(prompt_ids=torch.zeros(3, dtype=torch.long), prompt_attention_mask=torch.ones(3))
    with pytest.raises(ValueError, match="does not match"):
        RolloutRequest(prompt_ids=torch.zeros(2, 3, dtype=torch.long), prompt_attention_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="1-D of length 2"):
        RolloutBatch(torch.zeros(2, 5, dtype=torch.long), torch.ones(2, 5), torch.tensor([3]))
    batch = RolloutBatch(torch.zeros(2, 5, dtype=torch.long), torch.ones(2, 5), torch.tensor([3, 3]))
    assert (batch.batch_size, batch.seq_len) == (2, 5)
    sampling = SamplingConfig(max_new_tokens=4)
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.n_samples_per_prompt) == (1.0, 1.0, -1, 1)
    with pytest.raises(TypeError):
        RolloutEngine()  # type: ignore[abstract]


def test_factory_and_refused_options() -> None:
    with pytest.raises(ValueError, match="Unknown rollout engine 'vllm'"):
        build_rollout(RolloutConfig(engine="vllm"))
    with pytest.raises(ValueError, match="needs both student_engine and tokenizer"):
        build_rollout(RolloutConfig(), student_engine=object())
    engine, tok = object(), types.SimpleNamespace(pad_token_id=0, eos_token_id=1)
    rollout = build_rollout(RolloutConfig(), student_engine=engine, tokenizer=tok)
    assert isinstance(rollout, HybridEngineRollout) and rollout.engine is engine and rollout.tokenizer is tok
    assert rollout.sync_weights(step=3) is None and not rollout.use_graph_capture
    with pytest.warns(UserWarning, match="use_graph_capture .* not implemented in ds; greedy rollouts .* will raise"):
        graph = HybridEngineRollout(engine, tok, cfg=HybridEngineRolloutConfig(use_graph_capture=True))
    assert graph.use_graph_capture is True and graph.engine is engine and graph.tokenizer is tok


def _setup() -> tuple[Any, Any, RolloutRequest]:
    pytest.importorskip("transformers")
    from tiny_hf_models import build

    model = build("llama", seed=3)
    engine = make_engine(model, base_config(hybrid_engine={"enabled": True}))
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 96, (2, 6), generator=gen)
    ids[1, :2] = 0  # the second prompt is left-padded
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    return engine, model, RolloutRequest(prompt_ids=ids, prompt_attention_mask=mask)


def _reference(model: Any, request: RolloutRequest, n: int, new: int, **kwargs: Any) -> torch.Tensor:
    ids = request.prompt_ids.repeat_interleave(n, dim=0)
    mask = request.prompt_attention_mask.repeat_interleave(n, dim=0)
    return model.generate(ids, attention_mask=mask, max_new_tokens=new, eos_token_id=None, pad_token_id=0, **kwargs)


def test_greedy_rollout_is_the_models_greedy_generate_with_padding_after_eos() -> None:
    engine, model, request = _setup()
    expected = _reference(model, request, 1, 8, do_sample=False)
    no_eos = HybridEngineRollout(engine, types.SimpleNamespace(pad_token_id=0, eos_token_id=None))
    batch = no_eos.generate(request, SamplingConfig(max_new_tokens=8, temperature=0.0))
    assert torch.equal(batch.input_ids, expected) and batch.response_start_idx.tolist() == [6, 6]
    assert torch.equal(batch.attention_mask[:, :6], request.prompt_attention_mask)
    assert bool((batch.attention_mask[:, 6:] == 1).all())

    eos = int(expected[0, 6 + 2])  # row 0's third response token ends its sequence
    batch = HybridEngineRollout(engine, types.SimpleNamespace(pad_token_id=0, eos_token_id=eos)).generate(
        request, SamplingConfig(max_new_tokens=8, temperature=0.0)
    )
    for row in range(2):
        response = expected[row, 6:].tolist()
        end = response.index(eos) + 1 if eos in response else 8
        want = response[:end] + [0] * (8 - end)
        assert batch.input_ids[row, 6:].tolist() == want
        assert batch.attention_mask[row, 6:].tolist() == [1] * end + [0] * (8 - end)
    assert batch.input_ids[0, 6:].tolist().count(0) >= 5  # eos at index 2: five pads after it

    # CUDA-graph greedy decode: refused before any forward runs
    forwards = []
    handle = model.register_forward_pre_hook(lambda *_: forwards.append(1))
    with pytest.warns(UserWarning, match="use_graph_capture"):
        graph = HybridEngineRollout(
            engine,
            types.SimpleNamespace(pad_token_id=0, eos_token_id=eos),
            cfg=HybridEngineRolloutConfig(use_graph_capture=True),
        )
    with pytest.raises(NotImplementedError, match=r"use_graph_capture \(CUDA-graph greedy decode\) is not implemented"):
        graph.generate(request, SamplingConfig(max_new_tokens=8, temperature=0.0))
    handle.remove()
    assert forwards == []


def test_sampled_rollout_expands_prompts_and_matches_generate_under_the_same_seed() -> None:
    engine, model, request = _setup()
    sampling = SamplingConfig(max_new_tokens=5, temperature=0.7, top_p=0.9, top_k=20, n_samples_per_prompt=3)
    torch.manual_seed(11)
    expected = _reference(model, request, 3, 5, do_sample=True, temperature=0.7, top_p=0.9, top_k=20)
    torch.manual_seed(11)
    rollout = HybridEngineRollout(engine, types.SimpleNamespace(pad_token_id=0, eos_token_id=None))
    batch = rollout.generate(request, sampling)
    assert batch.input_ids.shape == (6, 11) and torch.equal(batch.input_ids, expected)
    assert torch.equal(batch.input_ids[:, :6], request.prompt_ids.repeat_interleave(3, dim=0))
    assert torch.equal(batch.attention_mask[:, :6], request.prompt_attention_mask.repeat_interleave(3, dim=0))
    assert batch.response_start_idx.tolist() == [6] * 6
    with pytest.warns(UserWarning, match="use_graph_capture"):  # sampled decode ignores it, as in DeepSpeed
        graph = HybridEngineRollout(
            engine, types.SimpleNamespace(pad_token_id=0, eos_token_id=None), HybridEngineRolloutConfig(True)
        )
    torch.manual_seed(11)
    assert torch.equal(graph.generate(request, sampling).input_ids, expected)
    with pytest.raises(NotImplementedError, match="continuous batching"):
        rollout.generate(request, SamplingConfig(max_new_tokens=2, continuous_batch_size=4))
    with pytest.raises(ValueError, match="max_new_tokens and n_samples_per_prompt must be >= 1"):
        rollout.generate(request, SamplingConfig(max_new_tokens=0))


def test_sample_top_p_draws_from_the_nucleus_with_its_renormalized_probabilities() -> None:
    from ds_engine.runtime.rollout.hybrid_engine_rollout import HybridEngineRollout

    sample = HybridEngineRollout._sample_top_p
    logits = torch.log(torch.tensor([[0.1, 0.5, 0.15, 0.25]]))
    # nucleus at 0.7: 0.5 and 0.25 (0.5 alone is below 0.7; with 0.25 it is 0.75); renormalized 2/3, 1/3
    torch.manual_seed(0)
    draws = torch.cat([sample(logits, top_p=0.7) for _ in range(3000)]).flatten()
    assert set(draws.tolist()) == {1, 3}
    assert abs((draws == 1).float().mean().item() - 2 / 3) < 0.03
    # top_p 1: every token, with its own probability; a tiny temperature: the argmax
    torch.manual_seed(0)
    whole = torch.cat([sample(logits.expand(4, 4), top_p=1.0) for _ in range(1000)]).flatten()
    assert abs((whole == 0).float().mean().item() - 0.1) < 0.03
    assert sample(logits, temperature=1e-10).item() == 1
    # a top_p below the most likely token's probability keeps that token alone
    assert sample(logits.expand(5, 4), top_p=0.01).flatten().tolist() == [1] * 5
