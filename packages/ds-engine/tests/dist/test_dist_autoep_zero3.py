"""AutoEP at ZeRO stage 3 on gloo ranks with a tiny config-built Mixtral (4 experts, top-2; nothing downloaded).

- training: at stage 3, autoep_size 2 trains like the unconverted model in plain PyTorch (torch Adam on every
  rank's batch, clipped), like autoep_size 1 and like autoep_size 2 at ZeRO 2 (losses and every weight, 1e-5
  in fp32), on 2 ranks (expert-data-parallel groups of 1) and 4 ranks (groups of 2, so
  the experts are really partitioned), with gradient clipping on; so does it with the optimizer offloaded to
  the host and overlap_comm off, and from a model already partitioned by zero.Init(module=...);
- placement: expert tensors are split over their expert-data-parallel group, the rest over all ranks;
- checkpoints: a save at stage 3 writes no per-expert files (as DeepSpeed: the experts are in the ZeRO
  partitions alone, its `ds_autoep_layers` entries marked `zero3_partitioned`) and resumes exactly (the next
  steps equal the uninterrupted run's); a 4-rank save re-partitions onto 2 ranks at the same autoep_size and
  trains on like the 4 ranks (1e-5); at autoep_size 1 its weights load exactly and, with its optimizer state,
  the next steps equal the saved run's continuation (1e-5); zero_to_fp32 and the consolidated 16-bit export
  refuse it (as DeepSpeed);
- bf16: trains at stage 3 with autoep_size 2 (losses close to fp32's);
- refusals: DeepSpeed's AutoEP stage-3 gate (hpZ) names the key before any conversion.

Needs ds-parallel and transformers; skipped without them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ds_comm.testing import run_ranks

pytest.importorskip("ds_parallel", reason="AutoEP needs ds-parallel: pip install 'ds-engine[parallel]'")
pytest.importorskip("transformers", reason="AutoEP converts Hugging Face models")

from autoep_cases import assert_weights_close  # noqa: E402
from autoep_cases import batch as _batch  # noqa: E402 - tests/dist is on the path
from autoep_cases import tiny_mixtral as _mixtral  # noqa: E402
from autoep_cases import train_steps as _steps  # noqa: E402

STEPS, TOL = 3, 1e-5


def _engine(ep: int, stage: int, *, bf16: bool = False, zero: dict[str, Any] | None = None, model: Any = None) -> Any:
    import ds_engine as deepspeed
    from ds_parallel import groups

    groups.reset_mesh()
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "gradient_clipping": 0.5,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 200, **(zero or {})},
        "expert_parallel": {"enabled": True, "autoep_size": ep, "preset_model": "mixtral"},
    }
    if bf16:
        config["bf16"] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=_mixtral() if model is None else model, config=config)
    return engine


def _full_weights(engine: Any, stage: int) -> dict[str, torch.Tensor]:
    """Every parameter whole (stage 3: gathered), the expert tensors joined over the expert-parallel group."""
    import ds_comm
    import ds_zero

    params = dict(engine.module.named_parameters())
    out = {}
    with ds_zero.GatheredParameters(list(params.values()), enabled=stage == 3):
        for name, p in params.items():
            value = p.detach().float().clone()
            if ".experts.w" in name:
                layer = engine.module.get_submodule(name.rsplit(".experts.", 1)[0])
                parts = [torch.empty_like(value) for _ in range(layer.ep_size)]
                ds_comm.all_gather(parts, value.contiguous(), group=layer.ep_group)
                value = torch.cat(parts)
            out[name] = value
    return out


def _placement(engine: Any) -> dict[str, int]:
    """Ranks each parameter is split over (stage 3)."""
    import ds_comm

    return {n: ds_comm.get_world_size(p.ds_process_group) for n, p in engine.module.named_parameters()}


def _train(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for stage, ep in ((3, 1), (3, 2), (2, 2)):
        engine = _engine(ep, stage)
        out[(stage, ep)] = (_steps(engine, rank, range(STEPS)), _full_weights(engine, stage))
        if (stage, ep) == (3, 2):
            out["placement"] = _placement(engine)
            out["norm"] = engine.get_global_grad_norm()
    # the optimizer on the host, each reduce-scatter waited for at once: the same training
    engine = _engine(2, 3, zero={"offload_optimizer": {"device": "cpu"}, "overlap_comm": False})
    out["offload"] = (_steps(engine, rank, range(STEPS)), _full_weights(engine, 3))
    # a model already partitioned (zero.Init(module=...)): its MoE blocks are gathered for the conversion
    import ds_zero

    model = _mixtral()
    ds_zero.Init(module=model)
    engine = _engine(2, 3, model=model)
    out["zero_init"] = (_steps(engine, rank, range(STEPS)), _full_weights(engine, 3))
    # save after 2 steps, go on 2 more; a fresh engine loads the save and runs the same 2 steps
    engine = _engine(2, 3)
    _steps(engine, rank, range(2))
    engine.save_checkpoint(root, tag="z3")
    out["saved"] = _full_weights(engine, 3)
    out["export"] = _refusal(engine._zero3_consolidated_16bit_state_dict)
    out["export16"] = _refusal(lambda: engine.save_16bit_model(root))
    out["after"] = (_steps(engine, rank, range(2, 4)), _full_weights(engine, 3))
    engine = _engine(2, 3)
    engine.load_checkpoint(root, tag="z3")
    out["resumed"] = (_steps(engine, rank, range(2, 4)), _full_weights(engine, 3))
    # at autoep_size 1: the expert ranges re-partition from the ZeRO partitions, with the optimizer state too
    engine = _engine(1, 3)
    engine.load_checkpoint(root, tag="z3")
    out["resumed_at_ep1"] = (_steps(engine, rank, range(2, 4)), _full_weights(engine, 3))
    engine = _engine(1, 3)
    engine.load_checkpoint(root, tag="z3", load_optimizer_states=False)
    out["loaded_at_ep1"] = _full_weights(engine, 3)
    out["files"] = sorted(p.name for p in (Path(root) / "z3").iterdir())
    states = torch.load(Path(root) / "z3" / "mp_rank_00_model_states.pt", weights_only=False)
    out["formats"] = [e["checkpoint_format"] for e in states["ds_autoep_layers"]]
    if rank == 0:
        import ds_zero

        out["zero_to_fp32"] = _refusal(lambda: ds_zero.get_fp32_state_dict_from_zero_checkpoint(root, tag="z3"))
    return out


def _refusal(call: Any) -> str:
    try:
        call()
    except (ValueError, NotImplementedError) as err:
        return f"{type(err).__name__}: {err}"
    return "not refused"


def _reference(world: int) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """Plain PyTorch: the unconverted model on every rank's batch (mean loss), clipped, torch Adam; per-rank
    losses per step and the weights under AutoEP's names."""
    model = _mixtral()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        each = [model(input_ids=_batch(r, step), labels=_batch(r, step)).loss for r in range(world)]
        opt.zero_grad()
        (sum(each) / world).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        losses.append([float(x.detach()) for x in each])
    out = {}
    for name, p in model.named_parameters():
        if name.endswith("experts.gate_up_proj"):
            head = name.removesuffix("gate_up_proj")
            out[head + "w1"], out[head + "w3"] = p.detach()[:, :24].clone(), p.detach()[:, 24:].clone()
        elif name.endswith("experts.down_proj"):
            out[name.removesuffix("down_proj") + "w2"] = p.detach().clone()
        else:
            out[name.replace("mlp.gate.", "mlp.router.gate.")] = p.detach().clone()
    return [list(x) for x in zip(*losses, strict=True)], out


def _check(results: list[dict[str, Any]], world: int) -> None:
    ref_losses, ref_weights = _reference(world)
    for rank, r in enumerate(results):
        (l1, w1), (l2, w2), (lz2, wz2) = r[(3, 1)], r[(3, 2)], r[(2, 2)]
        assert l1[0] != l1[-1]  # it trained
        assert max(abs(a - b) for a, b in zip(ref_losses[rank], l2, strict=True)) < TOL, (ref_losses[rank], l2)
        assert_weights_close(ref_weights, w2, TOL)
        (lo, wo), (li, wi) = r["offload"], r["zero_init"]
        for other in (l2, lz2, lo, li):
            assert max(abs(a - b) for a, b in zip(l1, other, strict=True)) < TOL, (l1, other)
        for other in (w1, wz2, wo, wi):
            assert_weights_close(other, w2, TOL)
        experts = {n: s for n, s in r["placement"].items() if ".experts.w" in n}
        dense = {n: s for n, s in r["placement"].items() if ".experts.w" not in n}
        assert experts and set(experts.values()) == {world // 2}
        assert set(dense.values()) == {world}
        assert r["norm"] is not None and r["norm"] > 0
        (la, wa), (lr, wr) = r["after"], r["resumed"]
        assert la == lr, (la, lr)
        assert_weights_close(wa, wr, 0.0)
        assert_weights_close(r["saved"], r["loaded_at_ep1"], 0.0)
        (l1r, w1r) = r["resumed_at_ep1"]
        assert max(abs(a - b) for a, b in zip(la, l1r, strict=True)) < TOL, (la, l1r)
        assert_weights_close(wa, w1r, TOL)
        for export in (r["export"], r["export16"]):
            assert export.startswith("NotImplementedError") and "for AutoEP with ZeRO Stage 3" in export, export
            assert "ds_to_universal.py" in export, export
    assert results[0]["zero_to_fp32"].startswith("AutoEPZero3CheckpointError"), results[0]["zero_to_fp32"]
    assert "zero3_partitioned" in results[0]["zero_to_fp32"]
    files = results[0]["files"]
    assert not [f for f in files if f.startswith("layer_") and "_expert_" in f], files
    assert results[0]["formats"] == ["zero3_partitioned", "zero3_partitioned"]


@pytest.mark.timeout(500)
def test_autoep_zero3_two_ranks_trains_like_ep1_and_zero2_and_resumes(tmp_path: Path) -> None:
    """EP 2 on 2 ranks: each expert tensor whole on its rank (expert-data-parallel groups of one)."""
    _check(run_ranks(2, _train, str(tmp_path), timeout_s=460), 2)


def _resume_on_two(rank: int, world: int, root: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Load the 4-rank save (2 steps) on 2 ranks at the same autoep_size and run steps 2 and 3 on the batches
    ranks r and r + 2 ran there (so the global batch is the same)."""
    del world
    engine = _engine(2, 3)
    engine.load_checkpoint(root, tag="z3")
    losses = []
    for step in (2, 3):
        ids = torch.cat([_batch(rank, step), _batch(rank + 2, step)])
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses, _full_weights(engine, 3)


@pytest.mark.timeout(800)
def test_autoep_zero3_four_ranks_partitions_experts_over_edp(tmp_path: Path) -> None:
    """EP 2 on 4 ranks: each expert tensor split over its 2-rank expert-data-parallel group. Its save re-partitions
    onto 2 ranks (expert-data-parallel groups of 1) at the same autoep_size and trains on as the 4 ranks did."""
    results = run_ranks(4, _train, str(tmp_path), timeout_s=560)
    _check(results, 4)
    for _, weights in run_ranks(2, _resume_on_two, str(tmp_path), timeout_s=200):
        assert_weights_close(weights, results[0]["after"][1], TOL)


def _bf16(rank: int, world: int) -> dict[str, Any]:
    del world
    out = {}
    for bf16 in (False, True):
        out[bf16] = _steps(_engine(2, 3, bf16=bf16), rank, range(STEPS))
    return out


@pytest.mark.timeout(400)
def test_autoep_zero3_bf16_trains_close_to_fp32() -> None:
    for r in run_ranks(2, _bf16, timeout_s=360):
        assert r[True][0] != r[True][-1]
        assert max(abs(a - b) for a, b in zip(r[False], r[True], strict=True)) < 0.05, r


def _refused(rank: int, world: int) -> str:
    del rank, world
    model = _mixtral()
    try:
        _engine(2, 3, zero={"zero_hpz_partition_size": 2})
    except ValueError as err:
        return f"{err} | {type(model.model.layers[0].mlp).__name__}"
    return "not refused"


@pytest.mark.timeout(200)
def test_autoep_zero3_refuses_hpz_by_key() -> None:
    for text in run_ranks(2, _refused, timeout_s=160):
        assert "zero_optimization.zero_hpz_partition_size=2" in text, text
