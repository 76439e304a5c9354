"""Universal checkpoints of AutoEP models on gloo ranks (the tiny config-built Mixtral, 4 experts).

- same topology (2 ranks, autoep_size 2, ZeRO 3 and 2): a save after 2 steps, converted by `ds_to_universal`,
  holds every expert tensor whole (`[4, ...]`, DeepSpeed's expert entries) equal to the trained weights; loaded
  with `checkpoint.load_universal`, the engine's weights and Adam states are the saved ones (the loaded engine
  saved and converted again gives the same files, exactly), and 2 more steps equal the uninterrupted run's (1e-6);
- topology changes (ZeRO 3): a 4-rank save at autoep_size 2 loads on 2 ranks at autoep_size 2 and on 4 ranks at
  autoep_size 4 and 1, and 2 more steps on the same global batches equal the uninterrupted 4-rank run (1e-5);
  `load_module_only` and `load_optimizer_states=False` load the weights exactly; a model with 8 experts is refused
  naming both local expert counts.

Needs ds-parallel and transformers; skipped without them.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ds_comm.testing import run_ranks

pytest.importorskip("ds_parallel", reason="AutoEP needs ds-parallel: pip install 'ds-engine[parallel]'")
pytest.importorskip("transformers", reason="AutoEP converts Hugging Face models")

from autoep_cases import assert_weights_close  # noqa: E402
from autoep_cases import batch as _batch  # noqa: E402 - tests/dist is on the path
from autoep_cases import tiny_mixtral as _mixtral  # noqa: E402
from test_dist_autoep_zero3 import _full_weights, _steps  # noqa: E402

_STATES = ("fp32", "exp_avg", "exp_avg_sq")


def _engine(ep: int, *, universal: bool = False, num_experts: int = 4, stage: int = 3) -> Any:
    import ds_engine as deepspeed
    from ds_parallel import groups

    groups.reset_mesh()
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "gradient_clipping": 0.5,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 200},
        "expert_parallel": {"enabled": True, "autoep_size": ep, "preset_model": "mixtral"},
    }
    if universal:
        config["checkpoint"] = {"load_universal": True}
    engine, *_ = deepspeed.initialize(model=_mixtral(num_experts), config=config)
    return engine


def _convert(root: str, tag: str) -> None:
    """Rank 0 converts `root/tag` into `root/<tag>_universal` (DeepSpeed's entry point, no injected state: an
    AutoEP save records its universal info), the others wait."""
    import ds_comm
    from ds_engine.checkpoint.ds_to_universal import main

    if ds_comm.get_rank() == 0:
        args = {
            "num_extract_workers": 1,
            "num_merge_workers": 1,
            "keep_temp_folder": False,
            "strict": True,
            "inject_missing_state": False,
        }
        main(SimpleNamespace(input_folder=f"{root}/{tag}", output_folder=f"{root}/{tag}_universal", **args))
    ds_comm.barrier()


def _universal_files(folder: Path) -> dict[str, Any]:
    """Every state file of a universal checkpoint: `<param>/<state>` -> its tensor (or entry)."""
    out = {}
    for path in sorted((folder / "zero").glob("*/*.pt")):
        out[f"{path.parent.name}/{path.stem}"] = torch.load(path, map_location="cpu", weights_only=False)
    return out


def _tensor(entry: Any) -> torch.Tensor:
    """A state file's tensor (an entry's `param`, a bare tensor, or a step), flat."""
    return torch.as_tensor(entry["param"] if isinstance(entry, dict) else entry).detach().reshape(-1)


def _same_topology(rank: int, world: int, root: str, stage: int) -> dict[str, Any]:
    del world
    engine = _engine(2, stage=stage)
    _steps(engine, rank, range(2))
    engine.save_checkpoint(root, tag="z3")
    out: dict[str, Any] = {"saved": _full_weights(engine, stage)}
    _convert(root, "z3")
    out["straight"] = (_steps(engine, rank, range(2, 4)), _full_weights(engine, stage))
    loaded = _engine(2, universal=True, stage=stage)
    loaded.load_checkpoint(root, tag="z3_universal")
    out["loaded"] = _full_weights(loaded, stage)
    out["step"] = loaded.global_steps
    loaded.save_checkpoint(root, tag="again")  # its weights and Adam states, converted the same way
    _convert(root, "again")
    out["resumed"] = (_steps(loaded, rank, range(2, 4)), _full_weights(loaded, stage))
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [3, 2])
def test_autoep_universal_round_trip_same_topology(tmp_path: Path, stage: int) -> None:
    results = run_ranks(2, _same_topology, str(tmp_path), stage, timeout_s=560)
    files = _universal_files(tmp_path / "z3_universal")
    saved = results[0]["saved"]
    assert any(key.endswith("/step") for key in files) == (stage < 3)  # stage 1/2 keep a step per parameter
    for name in ("model.layers.0.mlp.experts.w1", "model.layers.1.mlp.experts.w2"):
        for state in _STATES:
            entry = files[f"{name}/{state}"]
            assert entry["is_expert_param"] and entry["ep_num_experts"] == 4 and entry["param"].shape[0] == 4
        torch.testing.assert_close(files[f"{name}/fp32"]["param"], saved[name], rtol=0, atol=0)
    dense = "model.layers.0.self_attn.q_proj.weight"
    torch.testing.assert_close(_tensor(files[f"{dense}/fp32"]), saved[dense].reshape(-1), rtol=0, atol=0)
    assert torch.count_nonzero(files["model.layers.0.mlp.experts.w1/exp_avg_sq"]["param"]) > 0
    again = _universal_files(tmp_path / "again_universal")
    assert sorted(again) == sorted(files)
    for key, entry in files.items():  # the loaded engine holds exactly the saved weights and Adam states
        torch.testing.assert_close(_tensor(again[key]), _tensor(entry), rtol=0, atol=1e-6, msg=key)
    for r in results:
        assert r["step"] == 2
        assert_weights_close(r["loaded"], r["saved"], 1e-6)
        (ls, ws), (lr, wr) = r["straight"], r["resumed"]
        assert max(abs(a - b) for a, b in zip(ls, lr, strict=True)) < 1e-6, (ls, lr)
        assert_weights_close(wr, ws, 1e-6)


def _save_on_four(rank: int, world: int, root: str) -> dict[str, Any]:
    del world
    engine = _engine(2)
    _steps(engine, rank, range(2))
    engine.save_checkpoint(root, tag="z3")
    out: dict[str, Any] = {"saved": _full_weights(engine, 3)}
    _convert(root, "z3")
    out["straight"] = _full_weights_after(engine, rank)
    for ep in (4, 1):  # the same 4 ranks at another autoep_size
        loaded = _engine(ep, universal=True)
        loaded.load_checkpoint(root, tag="z3_universal")
        out[f"ep{ep}"] = _full_weights_after(loaded, rank)
    fresh = _engine(4, universal=True)
    fresh.load_checkpoint(root, tag="z3_universal", load_optimizer_states=False)
    out["weights_only"] = _full_weights(fresh, 3)
    wrong = _engine(2, universal=True, num_experts=8)
    try:
        wrong.load_checkpoint(root, tag="z3_universal")
        out["refused"] = "not refused"
    except ValueError as err:
        out["refused"] = str(err)
    return out


def _full_weights_after(engine: Any, rank: int) -> dict[str, torch.Tensor]:
    _steps(engine, rank, range(2, 4))
    return _full_weights(engine, 3)


def _load_on_two(rank: int, world: int, root: str) -> dict[str, Any]:
    """The 4-rank save on 2 ranks at autoep_size 2: rank r runs the batches ranks r and r + 2 ran (the same
    global batch)."""
    del world
    out: dict[str, Any] = {}
    engine = _engine(2, universal=True)
    engine.load_checkpoint(root, tag="z3_universal")
    for step in (2, 3):
        ids = torch.cat([_batch(rank, step), _batch(rank + 2, step)])
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    out["resumed"] = _full_weights(engine, 3)
    module_only = _engine(2, universal=True)
    module_only.load_checkpoint(root, tag="z3_universal", load_module_only=True)
    out["module_only"] = _full_weights(module_only, 3)
    return out


@pytest.mark.timeout(900)
def test_autoep_zero3_universal_loads_at_other_world_size_and_autoep_size(tmp_path: Path) -> None:
    four = run_ranks(4, _save_on_four, str(tmp_path), timeout_s=600)
    straight, saved = four[0]["straight"], four[0]["saved"]
    for r in four:
        for ep in (4, 1):
            assert_weights_close(r[f"ep{ep}"], straight, 1e-5)
        assert_weights_close(r["weights_only"], saved, 1e-6)
        assert "target_local_experts=4, checkpoint_local_experts=2" in r["refused"], r["refused"]
    for r in run_ranks(2, _load_on_two, str(tmp_path), timeout_s=250):
        assert_weights_close(r["resumed"], straight, 1e-5)
        assert_weights_close(r["module_only"], saved, 1e-6)
