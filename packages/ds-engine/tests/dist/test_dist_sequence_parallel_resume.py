"""ALST checkpoints resume at another sequence-parallel degree: a tiny Hugging Face Llama trained 3 steps at
SP=2 (or SP=2 x DP=2) under ZeRO, saved, and resumed at SP=1 x DP=2, SP=4, SP=2 x DP=1 or on one rank,
continues with the per-step losses of plain PyTorch training on the whole sequences (fp32, 1e-5), and the
fp32 master weights and Adam state it loads are exactly those saved (zero_to_fp32 reads the save too).

ZeRO partitions over data x sequence ranks, so the partition count of a save is dp x sp; loading
re-partitions onto this run's dp x sp ranks, whatever its split between the two.

Needs ds-parallel, ds-zero and transformers (the `ds-engine[all]` session); skipped without them.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from ds_comm.testing import run_ranks

pytest.importorskip("ds_parallel", reason="sequence parallelism needs ds-parallel: pip install 'ds-engine[parallel]'")
ds_zero = pytest.importorskip("ds_zero", reason="ZeRO needs ds-zero: pip install 'ds-engine[zero]'")
pytest.importorskip("transformers", reason="ALST wraps Hugging Face transformers models")

SEQ, VOCAB, LR = 16, 64, 1e-2
SAVED_STEPS, RESUMED_STEPS = 3, 3


def tiny_llama(attn: str) -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)


def sample(step: int, replica: int) -> dict[str, torch.Tensor]:
    """Data-parallel replica `replica`'s whole sequence at global step `step` (the same in every layout)."""
    gen = torch.Generator().manual_seed(1000 * step + replica)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=gen)
    return {"input_ids": ids, "labels": ids.clone()}


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01)


def _steps(
    rank: int, world: int, sp: int, stage: int, first: int, load: str | None, save: str | None
) -> dict[str, Any]:
    """Train steps `first` .. `first + n - 1` at SP=`sp` on `world` ranks, after loading `load`, then save to `save`."""
    import ds_engine as deepspeed

    n = RESUMED_STEPS if load else SAVED_STEPS
    if sp > 1:
        from ds_parallel.ulysses_sp import UlyssesSPAttentionHF

        mpu = UlyssesSPAttentionHF.register_with_transformers(
            tiny_llama("sdpa").config, "sdpa", sp, micro_batch_size=1, seq_length=SEQ
        )
        model = tiny_llama("ulysses")
        replica = mpu.get_data_parallel_rank()
    else:
        mpu, model, replica = None, tiny_llama("sdpa"), rank
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "sequence_parallel_size": sp,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=adamw, config=config, mpu=mpu)
    loaded = None
    if load:
        path, _ = engine.load_checkpoint(load)
        assert path is not None and engine.global_steps == first
        loaded = copy.deepcopy(engine.optimizer.state_dict())
    losses = []
    for mb in _micro_batches(mpu, replica, sp, first, n):
        out = engine(**mb, use_cache=False)
        if sp > 1:
            from ds_parallel.ulysses_sp import aggregate_sp_loss

            shard = engine.module.loss_function(
                logits=out.logits, labels=None, shift_labels=mb["shift_labels"], vocab_size=VOCAB
            )
            loss = aggregate_sp_loss(shard, mb["shift_labels"], mpu.get_sequence_parallel_group())
        else:
            loss = out.loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    if save:
        engine.save_checkpoint(save)
    return {"losses": torch.tensor(losses), "replica": replica, "loaded": loaded}


def _micro_batches(mpu: Any, replica: int, sp: int, first: int, n: int) -> Any:
    """Steps `first` .. `first + n - 1` of this rank's replica: whole sequences at SP=1; at SP > 1 the ALST
    adapter's shards, where SP peer k loads the sample of every SP-th step from `first + k` (the adapter
    runs the group's loads in peer order, so the group trains the steps in order)."""
    if sp == 1:
        yield from (sample(step, replica) for step in range(first, first + n))
        return
    from ds_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

    peer = mpu.get_sequence_parallel_rank()
    loads = -(-n // sp)
    loader = [sample(first + load * sp + peer, replica) for load in range(loads)]
    adapter = UlyssesSPDataLoaderAdapter(loader, peer, mpu.get_sequence_parallel_group(), sp, "cpu")
    for i, mb in enumerate(adapter):
        if i == n:
            return
        yield mb


def reference(replicas: list[int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Plain PyTorch on whole sequences: step t trains on the t-th sample of each of its `replicas[t]` replicas.
    Returns the per-step losses and the final weights."""
    model = tiny_llama("sdpa")
    opt = adamw(model.parameters())
    losses = []
    for step, count in enumerate(replicas):
        batch = [sample(step, g) for g in range(count)]
        loss = model(**{k: torch.cat([b[k] for b in batch]) for k in batch[0]}, use_cache=False).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return torch.tensor(losses), {name: p.detach() for name, p in model.named_parameters()}


def full_state(state_dicts: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """`{"<param>/fp32" | "<param>/<adam key>": full tensor}` from every rank's ZeRO state dict of one layout."""
    out: dict[str, torch.Tensor] = {}
    for sd in state_dicts:
        states = sd["base_optimizer_state"]["state"]
        for k, meta in enumerate(sd["partitions"]):
            values = {"fp32": sd["single_partition_of_fp32_groups"][k]}
            values.update({key: v for key, v in states.get(k, {}).items() if v.dim() == 1})
            for name, param_start, numel, start in meta["fragments"]:
                size = torch.Size(meta["param_shapes"][name]).numel()
                for key, value in values.items():
                    full = out.setdefault(f"{name}/{key}", torch.full((size,), float("nan")))
                    full[param_start : param_start + numel] = value[start : start + numel]
    return out


def _steps_of(state_dicts: list[dict[str, Any]]) -> set[float]:
    return {float(v["step"]) for sd in state_dicts for v in sd["base_optimizer_state"]["state"].values()}


def _check_losses(runs: list[dict[str, Any]], replicas: int, ref_losses: torch.Tensor) -> None:
    """The step's loss is the mean over replicas of each one's whole-sequence loss; SP peers agree exactly."""
    per_replica = torch.stack([next(r["losses"] for r in runs if r["replica"] == g) for g in range(replicas)])
    torch.testing.assert_close(per_replica.mean(0), ref_losses, atol=1e-5, rtol=1e-5)
    for r in runs:
        torch.testing.assert_close(r["losses"], per_replica[r["replica"]], atol=0, rtol=0)


def _check_loaded(ckpt: Path, runs: list[dict[str, Any]]) -> None:
    """Every rank's loaded partition, put together, is bit for bit the saved masters and Adam state."""
    on_disk = ds_zero.load_partition_state_dicts(ckpt, mp_rank=0)
    loaded = sorted((r["loaded"] for r in runs), key=lambda sd: sd["dp_rank"])
    assert [sd["partition_count"] for sd in loaded] == [len(runs)] * len(runs)
    want, got = full_state(on_disk), full_state(loaded)
    assert sorted(got) == sorted(want) and any(k.endswith("/exp_avg_sq") for k in want)
    for key, value in want.items():
        assert not value.isnan().any(), key
        torch.testing.assert_close(got[key], value, atol=0, rtol=0, msg=key)
    assert _steps_of(loaded) == _steps_of(on_disk) == {float(SAVED_STEPS)}


@pytest.mark.timeout(1200)
@pytest.mark.parametrize(
    ("stage", "saved", "resumed"),
    [
        (3, (2, 2), [(2, 1), (4, 4)]),
        (3, (4, 2), [(1, 1), (2, 2)]),
        (2, (4, 2), [(4, 4)]),
        (1, (2, 2), [(2, 1)]),
    ],
)
def test_alst_checkpoint_resumes_at_another_sp_degree(
    tmp_path: Path, stage: int, saved: tuple[int, int], resumed: list[tuple[int, int]]
) -> None:
    """Save at `saved`, resume from it at each of `resumed`: (world size, sequence-parallel degree) pairs;
    data-parallel replicas = world / degree."""
    world, sp = saved
    first = run_ranks(world, _steps, sp, stage, 0, None, str(tmp_path), timeout_s=360)
    ckpt = tmp_path / f"global_step{SAVED_STEPS}"
    meta = torch.load(ckpt / "mp_rank_00_model_states.pt", weights_only=False)
    assert meta["checkpoint_parallel_dimensions"]["sp_degree"] == sp and meta["dp_world_size"] == world
    assert len(ds_zero.load_partition_state_dicts(ckpt)) == world  # one partition per data x sequence rank
    ref_losses, ref_weights = reference([world // sp] * SAVED_STEPS)
    _check_losses(first, world // sp, ref_losses)
    # zero_to_fp32 reads the save like any other: the whole-sequence reference's weights. atol 1e-4: the SP
    # ranks sum a gradient in another order than one whole-sequence backward, and AdamW's g / sqrt(v) turns
    # last-bit differences on near-zero gradients into visible ones (seen: 1.9e-5 on 1 of 1024 elements).
    consolidated = ds_zero.get_fp32_state_dict_from_zero_checkpoint(tmp_path)
    for name, value in ref_weights.items():
        torch.testing.assert_close(
            consolidated[name], value, atol=1e-4, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
        )
    for world2, sp2 in resumed:
        second = run_ranks(world2, _steps, sp2, stage, SAVED_STEPS, str(tmp_path), None, timeout_s=360)
        ref, _ = reference([world // sp] * SAVED_STEPS + [world2 // sp2] * RESUMED_STEPS)
        _check_losses(second, world2 // sp2, ref[SAVED_STEPS:])
        _check_loaded(ckpt, second)
