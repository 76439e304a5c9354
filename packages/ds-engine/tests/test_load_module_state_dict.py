"""`engine.load_module_state_dict` with DeepSpeed 0.19.8's signature and meaning: the whole checkpoint dict,
`custom_load_fn`, `allowed_missing_keys` under strict and non-strict loads, ZeRO-3 parameters fetched for the
load (`fetch_z3_params`, `z3_params_to_fetch`), and a subclass override that `load_checkpoint` calls with the
checkpoint it read."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from ds_engine_testkit import base_config, make_engine, tiny_net

from ds_comm.testing import run_ranks

needs_zero = pytest.mark.skipif(importlib.util.find_spec("ds_zero") is None, reason="needs ds-zero (ZeRO configs)")


def _target_state(seed: int = 7) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in tiny_net(seed).state_dict().items()}


def _equal(engine: Any, state: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(engine.module.state_dict()[k], v) for k, v in state.items())


def test_the_checkpoint_dict_loads_its_module_entry_and_a_bare_state_dict_is_refused() -> None:
    engine = make_engine(tiny_net(0), base_config())
    target = _target_state()
    engine.load_module_state_dict({"module": target, "global_steps": 3})
    assert _equal(engine, target)
    with pytest.raises(TypeError, match=r"'module' entry .* \{'module': state_dict\}"):
        engine.load_module_state_dict(_target_state(8))


def test_custom_load_fn_gets_the_module_state_and_the_module() -> None:
    engine = make_engine(tiny_net(0), base_config())
    seen: dict[str, Any] = {}
    target = _target_state()
    engine.load_module_state_dict({"module": target}, custom_load_fn=lambda src, dst: seen.update(src=src, dst=dst))
    assert seen["src"] == target and seen["dst"] is engine.module
    assert not _equal(engine, target)  # the custom function did the loading (here: none)


def test_allowed_missing_keys_under_strict_and_non_strict_loads() -> None:
    engine = make_engine(tiny_net(0), base_config())
    target = _target_state()
    allowed = sorted(target)[:1]
    partial = {k: v for k, v in target.items() if k not in allowed}
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    engine.load_module_state_dict({"module": partial}, strict=True, allowed_missing_keys=allowed)
    after = engine.module.state_dict()
    assert all(torch.equal(after[k], v) for k, v in partial.items())
    assert all(torch.equal(after[k], before[k]) for k in allowed)
    other = sorted(target)[1]
    with pytest.raises(RuntimeError, match=rf"outside AutoEP expert parameters .*missing \['{other}'\]"):
        engine.load_module_state_dict(
            {"module": {k: v for k, v in partial.items() if k != other}}, strict=True, allowed_missing_keys=allowed
        )
    with pytest.raises(RuntimeError, match=r"unexpected \['stray'\]"):
        engine.load_module_state_dict(
            {"module": {**partial, "stray": torch.zeros(1)}}, strict=True, allowed_missing_keys=allowed
        )
    # non-strict stays non-strict: a stray key and missing keys beyond the allowed ones are fine
    engine.load_module_state_dict({"module": {"stray": torch.zeros(1)}}, strict=False, allowed_missing_keys=allowed)


class _Recording:
    """A subclass's override, as scripts write them: sees the checkpoint `load_checkpoint` read."""

    seen: list[dict[str, Any]] = []

    def load_module_state_dict(self, checkpoint: Any, strict: bool = True, custom_load_fn: Any = None, **kw: Any):
        _Recording.seen.append(dict(checkpoint))
        return super().load_module_state_dict(checkpoint, strict, custom_load_fn, **kw)  # type: ignore[misc]


def test_load_checkpoint_calls_an_override_with_the_whole_checkpoint(tmp_path: Path) -> None:
    engine = make_engine(tiny_net(0), base_config())
    engine.save_checkpoint(str(tmp_path), tag="t", client_state={"my": 1})
    other = make_engine(tiny_net(5), base_config())
    other.__class__ = type("RecordingEngine", (_Recording, type(other)), {})
    _Recording.seen.clear()
    other.load_checkpoint(str(tmp_path), tag="t")
    (checkpoint,) = _Recording.seen
    assert checkpoint["my"] == 1 and "global_steps" in checkpoint and "module" in checkpoint
    assert _equal(other, engine.module.state_dict())


def _zero3(rank: int, world: int) -> dict[str, bool]:
    del rank, world
    import ds_zero

    out = {}
    for how in ("plain", "fetch_all", "listed"):
        engine = make_engine(tiny_net(0), base_config(zero_optimization={"stage": 3}))
        params = list(engine.module.parameters())
        target = _target_state(int(len(out)) + 7)
        if how == "plain":
            engine.load_module_state_dict({"module": target})
        elif how == "fetch_all":
            engine.load_module_state_dict({"module": target}, fetch_z3_params=True)
        else:  # only the first parameter gathered; the rest loads as in the plain case
            engine.load_module_state_dict({"module": target}, z3_params_to_fetch=params[:1])
        with ds_zero.GatheredParameters(params):
            full = dict(engine.module.named_parameters())
            out[how] = all(torch.equal(full[k], target[k]) for k in full)
    return out


@needs_zero
@pytest.mark.timeout(200)
def test_zero3_loads_with_and_without_fetching_the_partitioned_parameters() -> None:
    for result in run_ranks(2, _zero3, timeout_s=160):
        assert result == {"plain": True, "fetch_all": True, "listed": True}, result
