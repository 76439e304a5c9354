"""Universal checkpoints from tensor-parallel (AutoTP) saves: `ds_to_universal` merges every rank's shards.

A tiny HF Llama (grouped kv heads) trains 3 steps with AdamW at TP=2 x DP=1 or TP=2 x DP=2 under ZeRO 1 or
2, saves, and goes on 2 steps (the reference). `convert_to_universal` turns the save into a universal
checkpoint with no `--inject_missing_state`: the save records how each parameter is cut
(`universal_checkpoint_info`). The universal files hold each parameter whole, equal to the weights and Adam
moments the engine itself gathers whole at save time (`module`, `optimizer_param_states`), exactly; row-parallel
weights are stored with `cat_dim` 1, column-parallel ones with 0, replicated ones with none. The checkpoint
then loads at TP=1 and at TP=2 with another data-parallel degree, and the next 2 steps' losses are the
reference's within 1e-5 (fp32: tensor-parallel matmuls and the data-parallel gradient average sum in another
order at another layout, as in `test_dist_autotp_checkpoint_optimizer.py`).

Every run sees the same global batch per step (2 micro-batches, split over the data-parallel ranks), so
layouts compare step for step. A model with a packed gate/up projection (two sections, each split on its
own) converts through the affine map its save records and resumes at TP=1 the same way; a save whose
record of the cut was removed is refused by name. Needs ds-zero, ds-parallel and transformers
(`ds-engine[all]`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ds_comm.testing import run_ranks

pytest.importorskip("ds_zero", reason="universal checkpoints need ds-zero: pip install 'ds-engine[zero]'")
pytest.importorskip("ds_parallel", reason="AutoTP needs ds-parallel: pip install 'ds-engine[parallel]'")
pytest.importorskip("transformers")

from tiny_hf_models import batch, build  # noqa: E402

BEFORE, AFTER = 3, 2
GLOBAL_MICROS = 2
TAG = f"global_step{BEFORE}"


def _config(tp: int, dp: int, stage: int, universal: bool) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": GLOBAL_MICROS // dp,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage},
    }
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def _steps(engine: Any, first: int, count: int) -> list[float]:
    """`count` steps; per step the mean loss over the global batch (the same at every layout)."""
    dp, dp_rank = engine.dp_world_size, engine.get_data_parallel_rank()
    gas = GLOBAL_MICROS // dp
    losses = []
    for step in range(first, first + count):
        total = torch.zeros(())
        for m in range(gas):
            ids = batch(seed=1000 * step + dp_rank * gas + m, size=2, seq=8)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        torch.distributed.all_reduce(total)  # tensor-parallel ranks repeat their replica's losses
        losses.append(total.item() / (torch.distributed.get_world_size() * gas))
    return losses


def _save_then_continue(rank: int, world: int, tp: int, stage: int, save_dir: str, family: str) -> list[float]:
    import ds_engine

    model = build(family, kv_heads=2)
    model.train()
    engine, *_ = ds_engine.initialize(model=model, config=_config(tp, world // tp, stage, False))
    _steps(engine, 0, BEFORE)
    engine.save_checkpoint(save_dir)
    return _steps(engine, BEFORE, AFTER)


def _load_universal(rank: int, world: int, tp: int, stage: int, load_dir: str, family: str) -> dict[str, Any]:
    import ds_engine

    model = build(family, kv_heads=2, seed=7)  # another init: everything must come from the checkpoint
    model.train()
    engine, *_ = ds_engine.initialize(model=model, config=_config(tp, world // tp, stage, True))
    path, _ = engine.load_checkpoint(load_dir)
    assert path is not None and engine.global_steps == BEFORE
    return {"losses": _steps(engine, BEFORE, AFTER), "o_cols": model.model.layers[0].self_attn.o_proj.weight.shape[1]}


def _check_universal_files(root: Path) -> None:
    """Each parameter whole, equal to what the engine gathered at save time; the category of each cut."""
    import ds_comm

    saved = ds_comm.load_checkpoint_file(root / TAG / "mp_rank_00_model_states.pt")
    module, whole = saved["module"], saved["optimizer_param_states"]["params"]
    zero = root / f"{TAG}_universal" / "zero"
    for name, states in whole.items():
        for key, value in states.items():
            stored = ds_comm.load_checkpoint_file(zero / name / f"{key}.pt")
            assert torch.equal(stored["param"], value), (name, key)
            if key == "fp32":
                assert torch.equal(stored["param"], module[name].float()), name
            if ".qkv_proj." in name or ".gate_up_proj." in name:  # fused sections: placed by an affine map
                assert list(stored) == ["param"], name
            elif ".o_proj." in name or ".down_proj." in name:  # row-parallel: the bias is added whole
                assert stored.get("cat_dim") == (1 if name.endswith(".weight") else None), name
            elif "_proj." in name or name.startswith("lm_head."):  # Llama's HF plan cuts the head by columns too
                assert stored["cat_dim"] == 0, name
            else:  # norms, embeddings: every rank holds them whole
                assert "cat_dim" not in stored, name
    assert {p.name for p in zero.iterdir()} >= set(whole)


@pytest.fixture(scope="module")
def saves(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, int], tuple[Path, list[float]]]:
    return {}


def _saved(
    saves: dict, tmp_path_factory: pytest.TempPathFactory, world: int, stage: int, family: str = "llama"
) -> tuple[Path, list[float]]:
    """The TP=2 save of `family` on `world` ranks at `stage`, converted (made once per module)."""
    import ds_zero

    if (world, stage, family) not in saves:
        root = tmp_path_factory.mktemp(f"{family}_tp2_on{world}_z{stage}")
        reference = run_ranks(world, _save_then_continue, 2, stage, str(root), family, timeout_s=300)[0]
        ds_zero.convert_to_universal(root / TAG, root / f"{TAG}_universal")
        saves[(world, stage, family)] = (root, reference)
    return saves[(world, stage, family)]


# (save world at TP=2, ZeRO stage, load TP, load world): TP=2 merged to TP=1; TP=2 x DP=1 resumed at TP=2 x DP=2;
# a stage-2 TP=2 x DP=2 save resumed at TP=2 x DP=1. (Each save costs a 4-rank run; these three cover merge,
# re-split and both DP directions with two saves.)
LOADS = [
    (2, 1, 1, 1),
    (2, 1, 2, 4),
    (4, 2, 2, 2),
]


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("save_world", "stage", "tp", "world"), LOADS)
def test_tp2_save_converts_and_resumes_at_another_layout(
    saves: dict, tmp_path_factory: pytest.TempPathFactory, save_world: int, stage: int, tp: int, world: int
) -> None:
    root, reference = _saved(saves, tmp_path_factory, save_world, stage)
    _check_universal_files(root)
    for result in run_ranks(world, _load_universal, tp, stage, str(root), "llama", timeout_s=300):
        assert result["o_cols"] == 32 // tp  # hidden 32: the weights are this layout's shards
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference), rtol=0, atol=1e-5)


class PackedBlock(torch.nn.Module):
    """An MLP with a packed gate/up projection: AutoTP cuts `gate_up_proj` as two sections, each split on its own."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.gate_up_proj = torch.nn.Linear(8, 2 * 12)
        self.down_proj = torch.nn.Linear(12, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(self.norm(x)).chunk(2, dim=-1)
        return x + self.down_proj(torch.nn.functional.silu(gate) * up)


class PackedMLPModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([PackedBlock(), PackedBlock()])
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _packed_run(rank: int, world: int, tp: int, save_dir: str, universal: bool) -> list[float]:
    """Train 3 steps and save (`universal` False), or load the universal checkpoint; then 2 more steps."""
    import ds_engine

    torch.manual_seed(7 if universal else 0)
    model = PackedMLPModel()
    cfg = {**_config(tp, world // tp, 1, universal), "train_micro_batch_size_per_gpu": 4}
    cfg["gradient_accumulation_steps"] = 1  # one replica, one micro-batch per step at every layout
    engine, *_ = ds_engine.initialize(model=model, model_parameters=model.parameters(), config=cfg)

    def steps(first: int, count: int) -> list[float]:
        out = []
        for step in range(first, first + count):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            out.append(loss.item())
        return out

    if universal:
        engine.load_checkpoint(save_dir)
    else:
        steps(0, BEFORE)
        engine.save_checkpoint(save_dir)
        assert model.layers[0].gate_up_proj.weight.shape == (12, 8)  # each rank: 6 rows of gate, 6 of up
    return steps(BEFORE, AFTER)


@pytest.mark.timeout(600)
def test_packed_projections_convert_by_their_sections(tmp_path: Path) -> None:
    """Each rank holds its piece of both sections of `gate_up_proj`; the save's affine map puts them back
    (written as `{"param"}` alone, as DeepSpeed's affine conversion does), and the universal checkpoint
    resumes at TP=1 within 1e-5 of the run that went on at TP=2."""
    import ds_zero

    reference = run_ranks(2, _packed_run, 2, str(tmp_path), False, timeout_s=300)[0]
    ds_zero.convert_to_universal(tmp_path / TAG, tmp_path / f"{TAG}_universal")
    _check_universal_files(tmp_path)
    (resumed,) = run_ranks(1, _packed_run, 1, str(tmp_path), True, timeout_s=300)
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(reference), rtol=0, atol=1e-5)


def test_a_tensor_parallel_save_without_its_cut_recorded_is_refused(
    saves: dict, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """Nothing would say which shards are rows, columns or copies: refused by name, nothing written."""
    import shutil

    import ds_comm
    import ds_zero

    root, _ = _saved(saves, tmp_path_factory, 2, 1)
    tag = tmp_path / TAG
    shutil.copytree(root / TAG, tag)
    states = ds_comm.load_checkpoint_file(tag / "mp_rank_00_model_states.pt")
    del states["universal_checkpoint_info"]
    ds_comm.atomic_save(states, tag / "mp_rank_00_model_states.pt")
    for inject in (False, True):
        with pytest.raises(ValueError, match=r"tensor-parallel rank 0 of 2 but has no 'universal_checkpoint_info'"):
            ds_zero.convert_to_universal(tag, tmp_path / "uni", inject_missing_state=inject)
    assert not (tmp_path / "latest_universal").exists()
