"""Tensors user code takes from ZeRO-3 parameters through the engine stay valid (2 gloo ranks).

* DeepSpeed-Chat's `save_zero_three_model` pattern after training with `deepspeed.initialize` at stage 3:
  `v.data.cpu()` collected inside `deepspeed.zero.GatheredParameters([v])` for every parameter, used after
  the block, `torch.save`d on rank 0. The file loads and holds the weights of a plain model trained with
  torch's AdamW on both ranks' batches (1e-6), and one more step still matches that model.
* The hybrid engine: a reference taken during `engine.generate()` (a forward hook keeping a layer's
  weight) holds that weight after generation has released the parameters (bitwise equal to an
  unpartitioned copy's).
* `offload_states()` / `reload_states()` (with every storage really copied out, as on an accelerator):
  memory the engine parks cannot be read while it is parked (a parameter's `.data` becomes a NaN
  placeholder; other references to it are documented as unreadable until `reload_states()`), and every
  reference taken before the offload (a persistent parameter's `.data`, a shard, an Adam moment) holds the
  same bytes after the reload. A snapshot taken inside `GatheredParameters` belongs to the user: the
  offload leaves it alone.

Needs ds-zero (the `ds-engine[all]` session); the hybrid-engine test needs transformers too.
"""

from __future__ import annotations

import copy
import io
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ds_comm.testing import run_ranks

pytest.importorskip("ds_zero", reason="ZeRO stage 3 through the engine needs ds-zero: pip install 'ds-engine[zero]'")

LR = 1e-2


def _readable(t: torch.Tensor) -> bool:
    """Whether `t`'s storage still holds every element it addresses (reading a shrunk storage crashes)."""
    extent = t.storage_offset() + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return t.numel() == 0 or t.untyped_storage().nbytes() >= extent * t.element_size()


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 40), nn.Tanh(), nn.LayerNorm(40), nn.Linear(40, 3))


def _data(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    full = [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(3)]
    return [(x.chunk(2)[rank], y.chunk(2)[rank]) for x, y in full]


def _config(threshold: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": threshold},
    }


def _train(engine: Any, data: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    losses = []
    for x, y in data:
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _plain_trained(steps: int) -> nn.Module:
    """The same model trained with torch's AdamW on both ranks' halves of each batch (what DP averages)."""
    net = _net()
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.0)
    for (x0, y0), (x1, y1) in zip(_data(0)[:steps], _data(1)[:steps], strict=True):
        loss = (nn.functional.mse_loss(net(x0), y0) + nn.functional.mse_loss(net(x1), y1)) / 2
        opt.zero_grad()
        loss.backward()
        opt.step()
    return net


# ------------------------------------------------------------------------ DeepSpeed-Chat's save pattern
def _save_zero_three_model(engine: Any, path: Path, rank: int) -> None:
    """Collect every parameter's gathered values inside a per-parameter block, save them on rank 0 after."""
    import ds_engine as deepspeed

    collected = {}
    for name, v in engine.module.named_parameters():
        if hasattr(v, "ds_id"):
            with deepspeed.zero.GatheredParameters([v]):
                value = v.data.cpu()  # on a CPU host: the gathered storage itself
        else:
            value = v.cpu()
        if rank == 0:
            collected[name] = value
    if rank == 0:
        torch.save(collected, path)


def _dschat_save(rank: int, world: int, root: str) -> dict[str, Any]:
    import ds_engine as deepspeed

    engine, *_ = deepspeed.initialize(model=_net(), config=_config(threshold=0))
    data = _data(rank)
    _train(engine, data[:2])
    path = Path(root) / "pytorch_model.bin"
    _save_zero_three_model(engine, path, rank)
    out: dict[str, Any] = {"released": {p.ds_status.name for p in engine.module.parameters()}}
    if rank == 0:
        try:
            state = torch.load(path, weights_only=True)
        except RuntimeError as err:
            out["load"] = f"torch.load failed: {err}"
        else:
            plain = _net()
            plain.load_state_dict(state)
            want = _plain_trained(2).state_dict()
            out["load"] = "ok"
            out["error"] = max((plain.state_dict()[k] - v).abs().max().item() for k, v in want.items())
    _train(engine, data[2:])  # the parameters whose old storage the saved tensors hold train on
    final = engine._zero3_consolidated_16bit_state_dict()
    if rank == 0:
        want = _plain_trained(3).state_dict()
        out["continued"] = max((final[k] - v).abs().max().item() for k, v in want.items())
    return out


def test_deepspeed_chat_save_pattern_after_stage3_training_writes_the_trained_weights(tmp_path: Path) -> None:
    results = run_ranks(2, _dschat_save, str(tmp_path), timeout_s=180)
    for r in results:
        assert r["released"] == {"NOT_AVAILABLE"}
    assert results[0]["load"] == "ok"
    assert results[0]["error"] < 1e-6, results[0]["error"]
    assert results[0]["continued"] < 1e-6, results[0]["continued"]


# --------------------------------------------------------------------------------------- hybrid engine
def _hybrid_generate(rank: int, world: int) -> dict[str, Any]:
    from tiny_hf_models import batch, build, greedy

    import ds_engine as deepspeed

    model = build("llama")
    ref = copy.deepcopy(model)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "hybrid_engine": {"enabled": True},
    }
    engine, *_ = deepspeed.initialize(model=model, config=config)
    taken: dict[str, torch.Tensor] = {}
    layer = model.model.layers[0].mlp.down_proj

    def keep(module: nn.Module, *_: Any) -> None:
        taken.setdefault("weight", module.weight.detach())
        taken.setdefault("row", module.weight.data[0])

    handle = layer.register_forward_hook(keep)
    engine.eval()
    greedy(engine.generate, batch(10 + rank, size=2, seq=5), 3)
    handle.remove()
    want = ref.model.layers[0].mlp.down_proj.weight.detach()
    return {
        "released": {p.ds_status.name for p in model.parameters()},
        "readable": all(_readable(t) for t in taken.values()),
        "equal": _readable(taken["weight"])
        and torch.equal(taken["weight"], want)
        and torch.equal(taken["row"], want[0]),
    }


def test_a_reference_taken_during_hybrid_generate_outlives_the_release() -> None:
    pytest.importorskip("transformers")
    for r in run_ranks(2, _hybrid_generate, timeout_s=240):
        assert r["released"] == {"NOT_AVAILABLE"}
        assert r["readable"] and r["equal"]


# -------------------------------------------------------------------------------------- offload_states
def _offload_round_trip(rank: int, world: int) -> dict[str, Any]:
    import ds_engine as deepspeed
    from ds_ops import StateOffloader

    StateOffloader.copy_on_same_device = True  # move every storage out, as on an accelerator
    engine, *_ = deepspeed.initialize(model=_net(), config=_config(threshold=60))
    data = _data(rank)
    _train(engine, data[:1])
    persistent = [p for p in engine.module.parameters() if p.ds_persist]
    partitioned = [p for p in engine.module.parameters() if not p.ds_persist]
    with deepspeed.zero.GatheredParameters([partitioned[0]]):
        snapshot = partitioned[0].data.cpu()
    moments = [s["exp_avg"] for s in engine.optimizer.optimizer.state.values()]
    refs = {"persistent": persistent[0].data, "shard": partitioned[0].ds_tensor, "exp_avg": moments[0]}
    before = {k: t.clone() for k, t in refs.items()}
    snapshot_before = snapshot.clone()
    engine.offload_states()
    while_parked = {k: _readable(t) for k, t in refs.items()}
    placeholder = bool(torch.isnan(persistent[0]).all())
    snapshot_kept = _readable(snapshot) and torch.equal(snapshot, snapshot_before)
    engine.reload_states()
    after = {k: _readable(t) and torch.equal(t, before[k]) for k, t in refs.items()}
    buf = io.BytesIO()
    torch.save({**refs, "snapshot": snapshot}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    saved = all(torch.equal(loaded[k], before[k]) for k in refs) and torch.equal(loaded["snapshot"], snapshot_before)
    return {
        "counts": (len(persistent), len(partitioned)),
        "while_parked": while_parked,
        "placeholder": placeholder,
        "snapshot_kept": snapshot_kept,
        "after": after,
        "saved": saved,
        "losses": _train(engine, data[1:]),
    }


def test_references_to_offloaded_states_are_parked_and_hold_their_bytes_after_reload() -> None:
    for r in run_ranks(2, _offload_round_trip, timeout_s=180):
        assert r["counts"][0] > 0 and r["counts"][1] > 0
        assert r["while_parked"] == {"persistent": False, "shard": False, "exp_avg": False}
        assert r["placeholder"] and r["snapshot_kept"]
        assert r["after"] == {"persistent": True, "shard": True, "exp_avg": True}
        assert r["saved"] and len(r["losses"]) == 2
