"""AutoEP on 2 gloo ranks with a tiny config-built Mixtral (4 experts, top-2; nothing downloaded).

- gradient parity: the model converted at autoep_size 2, each rank backpropagating its own batch, has the
  gradients of the unconverted model on both batches (expert rows from their owners, dense ones averaged);
- training: at ZeRO 1 and 2, autoep_size 2 trains like autoep_size 1 (losses and weights, 1e-4);
- checkpoints: saved at autoep_size 2 loads at 1 and the other way round with equal weights, in DeepSpeed's
  per-expert file layout; with its ZeRO optimizer state (re-partitioned across the expert ranges), the loaded
  run's next steps equal the saved run's own continuation (1e-4, the two degrees' rounding).

Needs ds-parallel and transformers; skipped without them.
"""

from __future__ import annotations

import copy
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

STEPS, TOL = 3, 1e-4


def _full_experts(engine: Any) -> dict[str, torch.Tensor]:
    """Every layer's full expert tensors, gathered over the expert-parallel group."""
    import ds_comm

    out = {}
    for name, p in engine.module.named_parameters():
        if ".experts.w" in name:
            layer = engine.module.get_submodule(name.rsplit(".experts.", 1)[0])
            parts = [torch.empty_like(p.data) for _ in range(layer.ep_size)]
            ds_comm.all_gather(parts, p.data.contiguous(), group=layer.ep_group)
            out[name] = torch.cat(parts)
        else:
            out[name] = p.detach().clone()
    return out


def _engine(ep: int, stage: int) -> Any:
    import ds_engine as deepspeed
    from ds_parallel import groups

    groups.reset_mesh()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage},
        "expert_parallel": {"enabled": True, "autoep_size": ep, "preset_model": "mixtral"},
    }
    engine, *_ = deepspeed.initialize(model=_mixtral(), config=config)
    return engine


def _grad_parity(rank: int, world: int) -> float:
    """Max |grad(converted at ep 2) - grad(unconverted on both batches)| over every parameter."""
    import ds_comm
    from ds_parallel.autoep import AutoEPOptions, convert_moe_model
    from ds_parallel.moe import create_expert_groups

    ref = _mixtral()
    model = copy.deepcopy(ref)
    groups = create_expert_groups(2)
    convert_moe_model(model, AutoEPOptions(autoep_size=2), ep_rank=groups.ep_rank, ep_group=groups.ep_group)
    sum(ref(input_ids=_batch(r, 0), labels=_batch(r, 0)).loss for r in range(world)).div(world).backward()
    ids = _batch(rank, 0)
    model(input_ids=ids, labels=ids).loss.backward()
    ref_grads = dict(ref.named_parameters())
    err = 0.0
    for name, p in model.named_parameters():
        g = p.grad / world
        if ".experts.w" not in name:
            ds_comm.all_reduce(g)
            ref_g = ref_grads[name.replace("router.gate.", "gate.")].grad
        else:
            block, w = name.rsplit(".experts.", 1)
            gate_up = ref_grads[f"{block}.experts.gate_up_proj"].grad
            full = {"w1": gate_up[:, :24], "w3": gate_up[:, 24:], "w2": ref_grads[f"{block}.experts.down_proj"].grad}[w]
            ref_g = full[2 * groups.ep_rank : 2 * groups.ep_rank + 2]
        err = max(err, (g - ref_g).abs().max().item())
    return err


def _train(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {"grad_err": _grad_parity(rank, world)}
    for stage in (1, 2):
        for ep in (1, 2):
            engine = _engine(ep, stage)
            out[(stage, ep)] = (_steps(engine, rank, range(STEPS)), _full_experts(engine))
            if stage == 2:
                engine.save_checkpoint(root, tag=f"ep{ep}")
                out[("after", ep)] = (_steps(engine, rank, range(STEPS, STEPS + 2)), _full_experts(engine))
    for save_ep, load_ep in ((2, 1), (1, 2)):
        engine = _engine(load_ep, 2)
        engine.load_checkpoint(root, tag=f"ep{save_ep}")  # the optimizer state too, across the expert ranges
        out[("resumed", save_ep, load_ep)] = (_steps(engine, rank, range(STEPS, STEPS + 2)), _full_experts(engine))
        engine = _engine(load_ep, 2)
        engine.load_checkpoint(root, tag=f"ep{save_ep}", load_optimizer_states=False)
        out[("loaded", save_ep, load_ep)] = _full_experts(engine)
    out["files"] = sorted(p.name for p in (Path(root) / "ep2").iterdir())
    out["report"] = engine.autoep_report.lines()
    return out


@pytest.mark.timeout(400)
def test_autoep_gradients_training_and_checkpoints_across_ep_degrees(tmp_path: Path) -> None:
    """One 2-rank job (the ranks' start-up is most of the cost): gradient parity, then training, then loads."""
    results = run_ranks(2, _train, str(tmp_path), timeout_s=360)
    for r in results:
        assert r["grad_err"] < 1e-6, r["grad_err"]
        for stage in (1, 2):
            (l1, w1), (l2, w2) = r[(stage, 1)], r[(stage, 2)]
            assert max(abs(a - b) for a, b in zip(l1, l2, strict=True)) < TOL, (stage, l1, l2)
            assert l1[0] != l1[-1]  # it trained
            assert_weights_close(w1, w2, TOL)
        saved = {1: r[(2, 1)][1], 2: r[(2, 2)][1]}
        assert_weights_close(r[("loaded", 2, 1)], saved[2], 0.0)
        assert_weights_close(r[("loaded", 1, 2)], saved[1], 0.0)
        for save_ep, load_ep in ((2, 1), (1, 2)):
            (la, wa), (lr, wr) = r[("after", save_ep)], r[("resumed", save_ep, load_ep)]
            assert max(abs(a - b) for a, b in zip(la, lr, strict=True)) < TOL, (save_ep, la, lr)
            assert_weights_close(wa, wr, TOL)
    files = results[0]["files"]
    for layer in (0, 1):
        for expert in range(4):
            assert f"layer_{layer}_expert_{expert}_mp_rank_00_model_states.pt" in files
    assert "model.layers.0.mlp: 4 experts" in "\n".join(results[0]["report"])
    entries = torch.load(tmp_path / "ep2" / "mp_rank_00_model_states.pt", weights_only=False)["ds_autoep_layers"]
    assert [(e["moe_layer_id"], e["module_path"], e["num_local_experts"], e["ep_size"]) for e in entries] == [
        (0, "model.layers.0.mlp", 2, 2),
        (1, "model.layers.1.mlp", 2, 2),
    ]
