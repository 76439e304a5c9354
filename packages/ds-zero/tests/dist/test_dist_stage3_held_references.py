"""A tensor taken from a gathered parameter stays valid after stage 3 releases the parameter (2 ranks).

DeepSpeed-Chat's `save_zero_three_model` collects `v.data.cpu()` (on a CPU host: the same storage) for
every parameter inside `GatheredParameters([v])` and `torch.save`s the dict on rank 0. Whatever such a
reference is (`p.data`, `p.data.cpu()`, `p.detach()`, a view like `p.data[0]`, a `state_dict()` value),
it keeps the gathered values after the release: the release gives the parameter back its placeholder and
frees the memory only when nothing else holds it, and later gathers never write into it. Every release
path is checked against the weights of a plain model built from the same seed (bit for bit before any
step; after SGD steps, against DistributedDataParallel on the same batches to 1e-6):

* `GatheredParameters` exit, for parameters partitioned under `ds_zero.Init` (no optimizer) and for
  parameters of a model under `DeepSpeedZeroOptimizer_Stage3`; the saved dict survives a `torch.save`
  / `torch.load` round trip and loads into the plain model; `model.state_dict()` taken inside the block;
* `param.partition()` after `param.all_gather()`;
* `ds_zero.Init`: a tensor the caller made a parameter of, a weight kept before its module finished
  construction, and a weight taken in `model.apply(fn)` (which gathers each module) inside the
  context; a child's weight read after the child was built is already its released placeholder (NaN);
* the releases of a training iteration: after a module's forward and backward, and from the prefetch
  and reuse pools (references taken in module hooks to every parameter gathered at that moment);
* NVMe parameter offload: a swapped shard is never a view of a swap buffer outside a gather, and
  references to the gathered values survive the buffers' reuse by later gathers and steps.

The same run with no reference held frees every gathered storage in place (the storage ds owns is
0 bytes after each release and is the same storage throughout): nothing ds itself holds keeps
gathered memory alive.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
from stage3_cases import STAGE3_CFG, batch, loss_fn, make_model, train_steps
from torch import nn

import ds_zero
from ds_comm.testing import run_ranks
from ds_zero import GatheredParameters, ZeroParamStatus
from ds_zero._params.partitioned_param import state_of

CFG = dict(STAGE3_CFG, stage3_param_persistence_threshold=0)  # every parameter is gathered and released
LR = 0.1
KINDS = ("data", "cpu", "detach", "view")


def _readable(t: torch.Tensor) -> bool:
    """Whether `t`'s storage still holds every element it addresses (reading a shrunk storage crashes)."""
    if t.numel() == 0:
        return True
    extent = t.storage_offset() + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return t.untyped_storage().nbytes() >= extent * t.element_size()


def _take(p: nn.Parameter) -> dict[str, torch.Tensor]:
    """The references user code takes from a gathered parameter."""
    return {"data": p.data, "cpu": p.data.cpu(), "detach": p.detach(), "view": p.data[0]}


def _collect(model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """DeepSpeed-Chat's pattern: one `GatheredParameters([p])` block per parameter, references kept."""
    out = {}
    for name, p in model.named_parameters():
        with GatheredParameters([p]):
            out[name] = _take(p)
    return out


def _max_error(refs: dict[str, dict[str, torch.Tensor]], expected: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per kind, the largest difference from `expected` (inf where a reference lost its memory)."""
    errors = dict.fromkeys(KINDS, 0.0)
    assert refs.keys() <= expected.keys()
    for name, taken in refs.items():
        for kind, t in taken.items():
            want = expected[name][0] if kind == "view" else expected[name]
            err = (t.float() - want.float()).abs().max().item() if _readable(t) else float("inf")
            errors[kind] = max(errors[kind], err)
    return errors


def _round_trip(refs: dict[str, dict[str, torch.Tensor]], expected: dict[str, torch.Tensor]) -> str:
    """`torch.save` the DeepSpeed-Chat dict, load it into a fresh plain model; "ok" or what went wrong."""
    if not all(_readable(t["cpu"]) for t in refs.values()):
        return "a saved tensor lost its memory"
    buf = io.BytesIO()
    torch.save({name: taken["cpu"] for name, taken in refs.items()}, buf)
    buf.seek(0)
    try:
        loaded = torch.load(buf, weights_only=True)
    except RuntimeError as err:
        return f"torch.load failed: {err}"
    plain = make_model(seed=3)
    missing = plain.load_state_dict(loaded, strict=False).missing_keys
    named = dict(plain.named_parameters())
    if any(k in named for k in missing):  # buffers and the tied lm_head are not in the dict
        return f"missing keys {missing}"
    worst = max((named[n].detach() - v).abs().max().item() for n, v in expected.items())
    return "ok" if worst == 0.0 else f"loaded values differ by {worst}"


def _plain_weights() -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in make_model().named_parameters()}


def _ddp_weights(rank: int, steps: int) -> list[dict[str, torch.Tensor]]:
    """The plain model's weights after each of `steps` SGD steps on every rank's batches (DDP)."""
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    out = []
    for step in range(steps):
        idx, tgt = batch(rank, step, 0)
        loss_fn(ddp(idx), tgt).backward()
        opt.step()
        opt.zero_grad()
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def _released(model: nn.Module) -> bool:
    """Every parameter released, and the full storage ds owns for it back to 0 bytes."""
    return all(
        p.ds_status is ZeroParamStatus.NOT_AVAILABLE and state_of(p).full_flat.untyped_storage().nbytes() == 0
        for p in model.parameters()
    )


def _stage3(model: nn.Module, config: dict[str, Any] | None = None) -> Any:
    base = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    return ds_zero.DeepSpeedZeroOptimizer_Stage3(model, base, config=config or CFG)


# ------------------------------------------------------------------------------ GatheredParameters exit
def _gathered_block(rank: int, world: int) -> dict[str, Any]:
    expected = _plain_weights()
    with ds_zero.Init(config_dict_or_path={"zero_optimization": CFG}):
        model = make_model()
    out: dict[str, Any] = {}
    refs = _collect(model)
    out["init_released"] = _released(model)
    out["init_errors"] = _max_error(refs, expected)
    out["init_round_trip"] = _round_trip(refs, expected)
    with GatheredParameters(model.parameters()):
        state = model.state_dict()
    params = dict(model.named_parameters())
    out["state_dict_error"] = _max_error({n: {"data": state[n]} for n in params}, expected)["data"]
    w = model.blocks[1].fc1.weight  # DeepSpeed's per-parameter methods release through the same path
    w.all_gather()
    held = _take(w)
    w.partition()
    out["partition_error"] = max(_max_error({"blocks.1.fc1.weight": held}, expected).values())

    ddp = _ddp_weights(rank, 2)
    managed = make_model()
    opt = _stage3(managed)
    before = _collect(managed)
    train_steps(managed, opt, rank, range(1), gas=1)
    after_one = _collect(managed)
    train_steps(managed, opt, rank, range(1, 2), gas=1)  # the held storages are not gathered into again
    after_two = _collect(managed)
    out["managed_released"] = _released(managed)
    out["managed_errors"] = [
        _max_error(before, expected),
        _max_error(after_one, ddp[0]),
        _max_error(after_two, ddp[1]),
    ]
    out["managed_round_trip"] = _round_trip(after_two, ddp[1]) if rank == 0 else "ok"
    return out


def test_references_taken_inside_gathered_parameters_keep_the_gathered_values() -> None:
    for r in run_ranks(2, _gathered_block, timeout_s=240):
        assert r["init_released"] and r["managed_released"]
        assert r["init_errors"] == dict.fromkeys(KINDS, 0.0), r["init_errors"]
        assert r["init_round_trip"] == "ok"
        assert r["state_dict_error"] == 0.0 and r["partition_error"] == 0.0
        before, after_one, after_two = r["managed_errors"]
        assert before == dict.fromkeys(KINDS, 0.0), before
        assert max(after_one.values()) < 1e-6 and max(after_two.values()) < 1e-6, (after_one, after_two)
        assert r["managed_round_trip"] == "ok"


# ------------------------------------------------------------------------------------------ zero.Init
class _Holder(nn.Module):
    """Makes a caller's tensor a parameter; keeps references to weights before and after they are partitioned."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)  # the caller's tensor: the same storage
        self.lin = nn.Linear(8, 16)  # under Init, partitioned when its own __init__ returns
        self.extra = nn.Parameter(torch.randn(16, 8))
        self.kept = self.extra.data  # partitioned only when this __init__ returns
        self.kept_child = self.lin.weight.data  # already released: its NaN placeholder


def _init_held(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(5)
    plain = _Holder(torch.zeros(4, 8))
    mine = torch.randn(4, 8, generator=torch.Generator().manual_seed(9))
    copy = mine.clone()
    torch.manual_seed(5)
    with ds_zero.Init(config_dict_or_path={"zero_optimization": CFG}):
        model = _Holder(mine)
        applied: list[torch.Tensor] = []
        model.apply(lambda m: applied.append(m.weight.data) if isinstance(m, nn.Linear) else None)
    held = {"mine": mine, "kept": model.kept, "applied": applied[0]}
    want = {"mine": copy, "kept": plain.extra.detach(), "applied": plain.lin.weight.detach()}
    ok = {k: _readable(t) and torch.equal(t, want[k]) for k, t in held.items()}
    buf = io.BytesIO()
    torch.save(held, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    return {
        "partitioned": all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in model.parameters()),
        "ok": ok,
        "saved": all(torch.equal(loaded[k], want[k]) for k in held),
        "child_placeholder": bool(torch.isnan(model.kept_child).all()) and model.kept_child.shape == (16, 8),
    }


def test_tensors_held_before_and_during_init_partitioning_stay_valid() -> None:
    for r in run_ranks(2, _init_held, timeout_s=120):
        assert r["partitioned"]
        assert r["ok"] == {"mine": True, "kept": True, "applied": True}
        assert r["saved"] and r["child_placeholder"]


# ---------------------------------------------------------------------------- a training iteration
def _hooked_references(rank: int, world: int) -> dict[str, Any]:
    """References taken in module hooks to every parameter gathered at that moment (own, prefetched, kept)."""
    expected = _plain_weights()
    config = dict(CFG, stage3_prefetch_bucket_size=3000, stage3_max_live_parameters=6000)
    model = make_model()
    opt = _stage3(model, config)
    names = {id(p): n for n, p in model.named_parameters()}
    taken: list[tuple[str, torch.Tensor]] = []
    foreign = 0

    def take(module: nn.Module, *_: Any) -> None:
        nonlocal foreign
        own = {id(p) for p in module.parameters(recurse=False)}
        for p in model.parameters():
            if p.ds_status is ZeroParamStatus.AVAILABLE:
                taken.append((names[id(p)], p.detach()))
                foreign += id(p) not in own

    handles = [m.register_forward_pre_hook(take) for m in model.modules()]
    handles += [m.register_forward_hook(take, prepend=True) for m in model.modules()]
    handles += [m.register_full_backward_hook(take) for m in model.modules()]
    train_steps(model, opt, rank, range(1), gas=1)  # every reference is taken before the step changes weights
    for h in handles:
        h.remove()
    bad = [n for n, t in taken if not _readable(t) or not torch.equal(t, expected[n])]
    return {
        "taken": len(taken),
        "names": len({n for n, _ in taken}),
        "foreign": foreign,
        "bad": sorted(set(bad)),
        "released": _released(model),
    }


def test_references_taken_during_forward_and_backward_survive_every_release() -> None:
    for r in run_ranks(2, _hooked_references, timeout_s=180):
        assert r["names"] == len(_plain_weights()) and r["foreign"] > 0  # foreign: prefetched or kept
        assert r["bad"] == [] and r["released"]


def _storages_with_no_reference(rank: int, world: int) -> dict[str, Any]:
    model = make_model()
    opt = _stage3(model, dict(CFG, stage3_prefetch_bucket_size=3000, stage3_max_live_parameters=6000))
    keys = {n: state_of(p).full_flat.untyped_storage()._cdata for n, p in model.named_parameters()}
    train_steps(model, opt, rank, range(2), gas=2)
    with GatheredParameters(model.parameters()):
        total = sum(p.float().sum().item() for p in model.parameters())  # used, not kept
    same = all(state_of(p).full_flat.untyped_storage()._cdata == keys[n] for n, p in model.named_parameters())
    return {"same": same, "released": _released(model), "finite": total == total}


def test_with_no_reference_held_the_gathered_storage_is_freed_in_place() -> None:
    for r in run_ranks(2, _storages_with_no_reference, timeout_s=180):
        assert r["same"] and r["released"] and r["finite"]


# ------------------------------------------------------------------------------------- NVMe offload
def _nvme_references(rank: int, world: int, root: str) -> dict[str, Any]:
    Path(root, "nvme").mkdir(exist_ok=True)
    expected = _plain_weights()
    ddp = _ddp_weights(rank, 1)
    config = dict(
        CFG,
        offload_param={
            "device": "nvme",
            "nvme_path": f"{root}/nvme",
            "buffer_count": 4,
            "buffer_size": 8192,
            "max_in_cpu": 0,
        },
    )
    model = make_model()
    opt = _stage3(model, config)
    swapped = [p for p in model.parameters() if state_of(p).swap is not None]
    swapper = state_of(swapped[0]).swap
    shard_in_pool = False
    refs = {}
    for name, p in model.named_parameters():
        with GatheredParameters([p]):
            refs[name] = _take(p)
            pool_keys = {b.untyped_storage()._cdata for pool in swapper._pools.values() for b in pool.buffers}
            shard_in_pool |= p.ds_tensor.untyped_storage()._cdata in pool_keys
    train_steps(model, opt, rank, range(1), gas=1)  # the swap buffers are reused, the shards rewritten
    after = _collect(model)
    return {
        "swapped": len(swapped),
        "shard_in_pool": shard_in_pool,
        "before": _max_error(refs, expected),
        "after": _max_error(after, ddp[0]),
        "released": _released(model),
    }


def test_nvme_offload_references_survive_swap_buffer_reuse(tmp_path: Any) -> None:
    for r in run_ranks(2, _nvme_references, str(tmp_path), timeout_s=240):
        assert r["swapped"] > 5 and not r["shard_in_pool"]
        assert r["before"] == dict.fromkeys(KINDS, 0.0), r["before"]
        assert max(r["after"].values()) < 1e-6, r["after"]
        assert r["released"]
