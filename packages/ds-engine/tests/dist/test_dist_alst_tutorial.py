"""DeepSpeed's ALST tutorial recipe, as written, on 2 ranks (SP=2): the same tiny Hugging Face Llama trained
without sequence parallelism gives the same per-step losses (1e-5), per-parameter gradients and weights after
plain SGD steps (fp32; atol 1e-6 + rtol 1e-5 on values up to ~0.1, measured differences ~2e-8), at ZeRO 1, 2
and 3.

The recipe: `register_with_transformers(core_attn_implementation="sdpa", seq_length_is_variable=True)` on a
model loaded with "sdpa" (not a separate attention name), user-supplied `position_ids`, the adapter's batches
(`shift_labels`, no `labels`) moved with `move_to_device`, each shard's loss from `model.loss_function(...,
labels=None, shift_labels=...)`, combined with `torch.distributed.nn.functional.all_gather` weighted by each
shard's real targets, `model.backward(loss)`. Each rank loads its own sample; the adapter runs the SP group's
in rank order, so step k trains on rank k's sample.

Needs ds-parallel, ds-zero and transformers (the `ds-engine[all]` session); skipped without them.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ds_comm.testing import run_ranks

pytest.importorskip("ds_parallel", reason="sequence parallelism needs ds-parallel: pip install 'ds-engine[parallel]'")
pytest.importorskip("ds_zero", reason="ZeRO needs ds-zero: pip install 'ds-engine[zero]'")
pytest.importorskip("transformers", reason="ALST wraps Hugging Face transformers models")

SEQ, VOCAB, SP, LR = 64, 128, 2, 0.1


def tiny_llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float()


def sample(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + index)
    return torch.randint(0, VOCAB, (SEQ,), generator=gen), torch.arange(SEQ)


def _tutorial(rank: int, world: int, stage: int) -> dict[str, Any]:
    import ds_engine as deepspeed
    from ds_engine.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    from ds_engine.runtime.utils import move_to_device
    from ds_engine.utils import groups, safe_get_full_grad

    model = tiny_llama()
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model,
        core_attn_implementation="sdpa",
        sequence_parallel_size=SP,
        micro_batch_size=1,
        seq_length=SEQ,
        seq_length_is_variable=True,
    )
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
        "sequence_parallel_size": SP,
    }
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, _, _, _ = deepspeed.initialize(config=config, model=model, optimizer=optimizer, mpu=mpu)

    sp_group = groups._get_sequence_parallel_group()
    sp_world_size = groups._get_sequence_parallel_world_size()
    sp_rank = groups._get_sequence_parallel_rank()

    def collate_fn(batch: Any) -> dict[str, torch.Tensor]:
        input_ids, position_ids = batch[0]
        return {
            "input_ids": input_ids.unsqueeze(0),
            "position_ids": position_ids.unsqueeze(0),
            "labels": input_ids.unsqueeze(0),
        }

    dl = torch.utils.data.DataLoader([sample(rank)], batch_size=1, collate_fn=collate_fn)
    dl = UlyssesSPDataLoaderAdapter(
        dl, sp_rank=sp_rank, sp_group=sp_group, sp_world_size=sp_world_size, device=model.device
    )
    steps = []
    for batch in dl:
        batch = move_to_device(batch, model.device)
        keys = sorted(batch)
        outputs = model(**batch)
        shift_labels = batch["shift_labels"]
        loss = model.module.loss_function(
            logits=outputs.logits, labels=None, shift_labels=shift_labels, vocab_size=model.module.config.vocab_size
        )
        losses_per_rank = torch.distributed.nn.functional.all_gather(loss, group=sp_group)
        good_tokens = (shift_labels != -100).view(-1).sum()
        good_tokens_per_rank = torch.distributed.nn.functional.all_gather(good_tokens, group=sp_group)
        total_loss = sum(losses_per_rank[r] * good_tokens_per_rank[r] for r in range(sp_world_size))
        total_good_tokens = sum(good_tokens_per_rank)
        loss = total_loss / max(total_good_tokens, 1)
        model.backward(loss)
        grads = {name: safe_get_full_grad(p).detach().clone() for name, p in model.module.named_parameters()}
        model.step()
        steps.append({"loss": loss.item(), "grads": grads, "keys": keys, "outputs_loss": outputs.loss})
    params = dict(model.module.named_parameters())
    ctx = deepspeed.zero.GatheredParameters(list(params.values())) if stage == 3 else torch.no_grad()
    with ctx:
        weights = {name: p.detach().clone() for name, p in params.items()}
    return {"steps": steps, "weights": weights}


def reference() -> tuple[list[float], list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """The same model trained on the whole sequences (rank 0's sample, then rank 1's) with plain SGD."""
    model = tiny_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], []
    for index in range(SP):
        input_ids, position_ids = sample(index)
        optimizer.zero_grad()
        loss = model(input_ids=input_ids[None], position_ids=position_ids[None], labels=input_ids[None]).loss
        loss.backward()
        losses.append(loss.item())
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        optimizer.step()
    return losses, grads, {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_tutorial_recipe_matches_training_without_sp(stage: int) -> None:
    ours = run_ranks(2, _tutorial, stage, timeout_s=360)
    ref_losses, ref_grads, ref_weights = reference()
    for rank, run in enumerate(ours):
        assert len(run["steps"]) == SP
        for step, got in enumerate(run["steps"]):
            assert abs(got["loss"] - ref_losses[step]) < 1e-5, (rank, step, got["loss"], ref_losses[step])
            for name, want in ref_grads[step].items():
                torch.testing.assert_close(
                    got["grads"][name],
                    want,
                    atol=1e-6,
                    rtol=1e-5,
                    msg=lambda m, n=name, s=step, r=rank: f"rank {r} step {s} grad of {n}: {m}",
                )
            assert got["keys"] == ["input_ids", "position_ids", "shift_labels"]
            assert got["outputs_loss"] is None  # no labels in the batch: the model computes no loss itself
        for name, want in ref_weights.items():
            torch.testing.assert_close(
                run["weights"][name], want, atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"{n} after SGD: {m}"
            )
