"""Random-LTD through initialize(): a tiny GPT-like model trains with token dropping, and its checkpoint round-trips.

The engine builds the random-LTD scheduler from `data_efficiency.data_routing.random_ltd`, steps it at each
training forward, and wraps nothing itself: `convert_to_random_ltd(engine, Block)` does, then wires the
listed layers. Checked: the kept length per step (the fixed_linear schedule), that a dropping forward
equals a plain-PyTorch forward that runs the same blocks on the same kept positions, that eval runs every
token, that the checkpoint stores the scheduler state under `random_ltd` and the weights under names
without `.random_ltd_layer`, and that a fresh engine restores both and goes on identically.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from ds_engine_testkit import make_engine
from torch import nn

from ds_engine._data.ltd_helpers import (
    convert_to_random_ltd,
    remove_random_ltd_state_dict,
    save_without_random_ltd,
)
from ds_engine._data.token_drop import RandomLayerTokenDrop
from ds_engine.config import DeepSpeedConfigError

VOCAB, HIDDEN, SEQ, BATCH = 16, 8, 8, 2


class Block(nn.Module):
    """Causal single-head attention and an MLP, both residual; the mask arrives as a keyword."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.mlp = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / HIDDEN**0.5
        assert attention_mask is not None and attention_mask.shape[-1] == x.shape[1]
        scores = scores.masked_fill(~attention_mask[:, 0], float("-inf"))
        x = x + torch.softmax(scores, dim=-1) @ v
        return x + torch.tanh(self.mlp(x))


class TinyGPT(nn.Module):
    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        mask = torch.tril(torch.ones(SEQ, SEQ, dtype=torch.bool)).expand(ids.shape[0], 1, SEQ, SEQ)
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, attention_mask=mask)
        return nn.functional.cross_entropy(self.head(x).reshape(-1, VOCAB), labels.reshape(-1))


def _config(**ltd: Any) -> dict[str, Any]:
    section = {
        "enabled": True,
        "total_layer_num": 3,
        "random_ltd_layer_num": 2,
        "random_ltd_layer_id": [1, 2],
        "model_mask_name": "attention_mask",
        "model_type": "decoder",
        "hidden_state_order": "batch_seq_dim",
        "random_ltd_schedule": {
            "min_value": 4,
            "max_value": SEQ,
            "schedule_type": "fixed_linear",
            "schedule_config": {"require_steps": 4, "seq_per_step": 2},
        },
    }
    section.update(ltd)
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "data_efficiency": {"enabled": True, "data_routing": {"enabled": True, "random_ltd": section}},
    }


def _engine(seed: int = 0, config: dict[str, Any] | None = None) -> Any:
    torch.manual_seed(seed)
    engine = make_engine(TinyGPT(), config or _config())
    return convert_to_random_ltd(engine, Block)


def _data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [
        (torch.randint(VOCAB, (BATCH, SEQ), generator=g), torch.randint(VOCAB, (BATCH, SEQ), generator=g))
        for _ in range(n)
    ]


def _train(engine: Any, data: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[list[int], list[float]]:
    kept, losses = [], []
    for ids, labels in data:
        loss = engine(ids, labels)
        kept.append(engine.random_ltd_scheduler.get_current_seq())
        losses.append(float(loss.detach()))
        engine.backward(loss)
        engine.step()
    return kept, losses


def test_engine_builds_the_scheduler_and_getters_answer() -> None:
    engine = _engine()
    assert engine.random_ltd_enabled() and engine.data_efficiency_enabled()
    assert not engine.curriculum_learning_enabled() and not engine.data_sampling_enabled()
    config = engine.random_ltd_config()
    assert (config["global_batch_size"], config["micro_batch_size"]) == (BATCH * 2, BATCH)
    assert engine.data_efficiency_config()["data_routing"]["random_ltd"] is config
    assert engine.data_sampling_config()["num_epochs"] == 1000
    assert engine.curriculum_learning_config() == {"enabled": False}
    wrapped = [m for m in engine.module.modules() if isinstance(m, RandomLayerTokenDrop)]
    assert [m.random_ltd_layer_id for m in wrapped] == [-1, 0, 1]  # layer 0 is wrapped but not listed


def test_kept_length_follows_the_schedule_and_training_learns() -> None:
    engine = _engine()
    kept, losses = _train(engine, _data(1) * 12)  # one batch again and again: the loss must fall
    # two micro-batches per step; fixed_linear from 4 to 8 over 4 steps in multiples of 2
    assert kept == [4, 4, 4, 4, 6, 6, 6, 6, 8, 8, 8, 8]
    assert engine.global_steps == 6
    assert engine.random_ltd_scheduler.state["consumed_layer_tokens"] == sum(
        4 * (k * 2 + SEQ * 1) for k in (4, 4, 6, 6, 8, 8)
    )
    assert losses[-1] < losses[0]


def test_dropping_forward_equals_plain_indexing_reference() -> None:
    engine = _engine()
    ids, labels = _data(1)[0]
    torch.manual_seed(11)
    loss = engine(ids, labels)
    indices = engine.random_ltd_scheduler.state["sample_idx"].long()
    assert indices.shape == (2, BATCH, 4)

    model = copy.deepcopy(engine.module)
    blocks = [layer.random_ltd_layer for layer in model.layers]
    mask = torch.tril(torch.ones(SEQ, SEQ, dtype=torch.bool)).expand(BATCH, 1, SEQ, SEQ)
    x = model.embed(ids)
    x = blocks[0](x, attention_mask=mask)
    for slot, block in enumerate(blocks[1:]):
        rows = []
        for b in range(BATCH):
            keep = indices[slot, b]
            part = block(x[b : b + 1, keep], attention_mask=mask[b : b + 1, :, :4, :4])
            row = x[b].clone()
            row[keep] = part[0]
            rows.append(row)
        x = torch.stack(rows)
    reference = nn.functional.cross_entropy(model.head(x).reshape(-1, VOCAB), labels.reshape(-1))
    torch.testing.assert_close(loss, reference, rtol=1e-6, atol=1e-6)


def test_eval_runs_every_token() -> None:
    engine = _engine()
    ids, labels = _data(1)[0]
    engine.eval()
    plain = TinyGPT()
    plain.load_state_dict(save_without_random_ltd(engine))
    with torch.no_grad():
        torch.testing.assert_close(engine(ids, labels), plain(ids, labels))
    assert engine.random_ltd_scheduler.state["current_steps"] == -1  # eval forwards do not step the schedule


def test_checkpoint_round_trips_scheduler_and_weights(tmp_path: Any) -> None:
    data = _data(12)
    engine = _engine()
    _train(engine, data[:6])
    engine.save_checkpoint(str(tmp_path), tag="t")
    saved = torch.load(tmp_path / "t" / "mp_rank_00_model_states.pt", weights_only=False)
    assert saved["random_ltd"] == engine.random_ltd_scheduler.state_dict()
    assert saved["random_ltd"]["current_value"] == 6 and saved["random_ltd"]["current_steps"] == 2
    assert not any(".random_ltd_layer" in key for key in saved["module"])
    assert set(saved["module"]) == set(TinyGPT().state_dict())

    torch.manual_seed(0)
    kept_after, _ = _train(engine, data[6:])
    resumed = _engine(seed=3)
    resumed.load_checkpoint(str(tmp_path), tag="t")
    assert resumed.random_ltd_scheduler.state_dict() == saved["random_ltd"]
    for a, b in zip(
        remove_random_ltd_state_dict(resumed.module.state_dict()).values(), saved["module"].values(), strict=True
    ):
        assert torch.equal(a, b)
    torch.manual_seed(0)
    assert _train(resumed, data[6:])[0] == kept_after == [6, 6, 8, 8, 8, 8]
    assert resumed.random_ltd_scheduler.state_dict() == engine.random_ltd_scheduler.state_dict()


@pytest.mark.parametrize(
    ("ltd", "message"),
    [
        ({"random_ltd_layer_num": 3}, "random_ltd_layer_num=3 must equal the length of random_ltd_layer_id"),
        ({"hidden_state_order": "bsh"}, "data_efficiency.data_routing.random_ltd.hidden_state_order"),
        ({"random_ltd_layer_id": [1, 3]}, "distinct layer indices in 0..2"),
        ({"random_ltd_schedule": None}, "random_ltd_schedule is not set"),
        ({"layer_token_lr_schedule": {"enabled": True}}, "layer_token_lr_schedule.enabled"),
    ],
)
def test_bad_random_ltd_config_is_refused_by_key_path(ltd: dict[str, Any], message: str) -> None:
    with pytest.raises(DeepSpeedConfigError, match=message.replace(".", r"\.").replace("[", r"\[")) as err:
        make_engine(TinyGPT(), _config(**ltd))
    assert "data_efficiency.data_routing.random_ltd" in str(err.value)


def test_wiring_mismatch_and_missing_switch_are_refused() -> None:
    torch.manual_seed(0)
    engine = make_engine(TinyGPT(), _config())
    with pytest.raises(ValueError, match="random_ltd_layer_num=2 but 1 RandomLayerTokenDrop"):
        engine.module.layers[1] = RandomLayerTokenDrop(engine.module.layers[1])  # layer 2 left unwrapped
        engine.random_ltd_initialize()
    off = make_engine(TinyGPT(), {k: v for k, v in _config().items() if k != "data_efficiency"})
    assert not off.random_ltd_enabled() and off.random_ltd_scheduler is None
    with pytest.raises(RuntimeError, match="random_ltd.enabled"):
        off.random_ltd_initialize()


def test_explain_shows_the_random_ltd_choices() -> None:
    from ds_engine.config import DeepSpeedConfig
    from ds_engine.explain import explain

    text = explain(DeepSpeedConfig(_config()), device_type="cpu")
    assert "random-LTD: layers [1, 2] of 3 run on a random subset of tokens (decoder, batch_seq_dim" in text
    assert "kept tokens: 4 -> 8 over 4 steps (fixed_linear, multiples of 2)" in text
    assert "global_batch_size=4" in text
    off = explain(DeepSpeedConfig({"train_batch_size": 2}), device_type="cpu")
    assert "random-LTD: off" in off


class PositionalMaskBlock(Block):
    """The mask as the second positional argument, as Hugging Face's blocks take it."""

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
        return super().forward(x, attention_mask=attention_mask) * scale


def test_mask_passed_by_position_is_cut_to_the_kept_tokens() -> None:
    """DeepSpeed's wrapper takes keywords only (a positional mask is a TypeError there); ds finds the mask by name."""
    torch.manual_seed(0)
    model = TinyGPT()
    model.layers = nn.ModuleList(PositionalMaskBlock() for _ in range(3))

    def forward(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        mask = torch.tril(torch.ones(SEQ, SEQ, dtype=torch.bool)).expand(ids.shape[0], 1, SEQ, SEQ)
        x = model.embed(ids)
        for layer in model.layers:
            x = layer(x, mask, 1.0)
        return nn.functional.cross_entropy(model.head(x).reshape(-1, VOCAB), labels.reshape(-1))

    model.forward = forward  # type: ignore[method-assign]
    engine = convert_to_random_ltd(make_engine(model, _config()), PositionalMaskBlock)
    kept, losses = _train(engine, _data(1) * 4)
    assert kept == [4, 4, 4, 4] and losses[-1] < losses[0]  # Block asserts the mask matches the kept length


def test_hugging_face_gpt2_trains_with_random_ltd() -> None:
    """DeepSpeedExamples' random-LTD finetuning recipe: convert_to_random_ltd(engine, GPT2Block)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    torch.manual_seed(0)
    hf_config = transformers.GPT2Config(n_layer=3, n_embd=16, n_head=2, vocab_size=32, n_positions=16)
    hf_config._attn_implementation = "eager"  # a 4-D mask tensor, cut to the kept tokens
    config = _config(model_mask_name="attention_mask")
    config["data_efficiency"]["data_routing"]["random_ltd"]["random_ltd_schedule"].update(
        min_value=8, max_value=16, schedule_config={"require_steps": 4, "seq_per_step": 4}
    )
    engine = convert_to_random_ltd(make_engine(transformers.GPT2LMHeadModel(hf_config), config), GPT2Block)
    ids = torch.randint(32, (BATCH, 16), generator=torch.Generator().manual_seed(2))
    kept, losses = [], []
    for _ in range(6):
        out = engine(input_ids=ids, labels=ids)
        kept.append(engine.random_ltd_scheduler.get_current_seq())
        losses.append(float(out.loss.detach()))
        engine.backward(out.loss)
        engine.step()
    assert kept == [8, 8, 8, 8, 12, 12]
    assert engine.random_ltd_scheduler.state["sample_idx"].shape == (2, BATCH, 12)  # the last forward kept 12
    assert losses[-1] < losses[0]
    assert set(save_without_random_ltd(engine)) == set(transformers.GPT2LMHeadModel(hf_config).state_dict())


class Mix(nn.Module):
    """A token-wise residual layer for a pipeline: one tensor in, one out."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


def test_pipeline_engine_drops_tokens_in_its_layers() -> None:
    """PipelineModule runs its layers from a list: the wrappers must land there, and train_batch steps the schedule."""
    ds_pipe = pytest.importorskip("ds_pipe")
    torch.manual_seed(0)
    specs = [ds_pipe.LayerSpec(Mix) for _ in range(3)]
    module = ds_pipe.PipelineModule(specs, num_stages=1, loss_fn=lambda out, y: nn.functional.mse_loss(out, y))
    engine = convert_to_random_ltd(make_engine(module, _config(model_mask_name=None)), Mix)
    assert [type(f).__name__ for f in module.forward_funcs] == ["RandomLayerTokenDrop"] * 3
    g = torch.Generator().manual_seed(6)
    data = [(torch.randn(BATCH, SEQ, HIDDEN, generator=g), torch.randn(BATCH, SEQ, HIDDEN, generator=g))] * 6
    it = iter(data)
    kept = []
    for _ in range(3):
        engine.train_batch(it)
        kept.append(engine.random_ltd_scheduler.get_current_seq())
        assert engine.random_ltd_scheduler.state["sample_idx"].shape[-1] == kept[-1] or kept[-1] == SEQ
    assert kept == [4, 4, 6]
