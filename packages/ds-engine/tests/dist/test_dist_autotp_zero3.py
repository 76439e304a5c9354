"""AutoTP with ZeRO stage 3: each tensor-parallel shard partitioned over the data-parallel ranks.

TP=2 x DP=2 on 4 ranks trains a tiny HF Llama with the losses, the gradient norms (clipping on, so the
norm decides every update) and the whole weights of DP=2 alone at stage 3 (fp32, SGD; 1e-5 / 1e-4);
TP=2 alone on 2 ranks (stage 3 over a data-parallel group of one) equals one rank.
The norm counts each replicated parameter once over the tensor-parallel ranks: counting it on both
would change the norm, the clip and the losses. A checkpoint saved at TP=2 x DP=2 and loaded into a
fresh engine resumes with the same losses.

Needs ds-parallel, ds-zero and transformers (the `ds-engine[all]` session); skipped without them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ds_comm.testing import run_ranks

pytest.importorskip("ds_parallel", reason="AutoTP needs ds-parallel: pip install 'ds-engine[parallel]'")
pytest.importorskip("ds_zero", reason="ZeRO stage 3 needs ds-zero: pip install 'ds-engine[zero]'")
pytest.importorskip("transformers")

from tiny_hf_models import batch, build  # noqa: E402

STEPS = 4


def _config(tp: int) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "SGD", "params": {"lr": 0.2, "momentum": 0.9}},
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
    }
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    return cfg


def _steps(engine: Any, first: int, count: int) -> tuple[list[float], list[float]]:
    dp_rank, dp = engine.get_data_parallel_rank(), engine.dp_world_size
    losses, norms = [], []
    for step in range(first, first + count):
        ids = batch(seed=1000 + step * dp + dp_rank, size=2, seq=8)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(float(engine.get_global_grad_norm()))
    return losses, norms


def _train(rank: int, world: int, tp: int, save_dir: str | None) -> dict[str, Any]:
    import ds_engine as deepspeed

    engine, *_ = deepspeed.initialize(model=build("llama", kv_heads=2).train(), config=_config(tp))
    losses, norms = _steps(engine, 0, STEPS)
    out: dict[str, Any] = {"losses": losses, "norms": norms, "dp": engine.dp_world_size}
    out["full"] = {k: v.clone() for k, v in engine.module_state_dict().items()}
    if save_dir is not None:
        engine.save_checkpoint(save_dir, tag="z3tp")
        out["after"] = _steps(engine, STEPS, 2)[0]
    return out


def _resume(rank: int, world: int, save_dir: str) -> list[float]:
    import ds_engine as deepspeed

    engine, *_ = deepspeed.initialize(model=build("llama", kv_heads=2, seed=7).train(), config=_config(2))
    engine.load_checkpoint(save_dir, tag="z3tp")
    return _steps(engine, STEPS, 2)[0]


@pytest.mark.timeout(900)
def test_tp2_by_dp2_zero3_equals_dp2_zero3_and_resumes(tmp_path: Path) -> None:
    ref = run_ranks(2, _train, 1, None, timeout_s=300)
    results = run_ranks(4, _train, 2, str(tmp_path), timeout_s=400)
    for rank, r in enumerate(results):
        assert r["dp"] == 2
        mine = ref[rank // 2]  # consecutive ranks form a TP group; the groups are the DP replicas
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(mine["losses"]), rtol=0, atol=1e-5)
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(mine["norms"]), rtol=1e-5, atol=1e-5)
        assert r["full"].keys() == mine["full"].keys()
        for k, v in mine["full"].items():
            torch.testing.assert_close(r["full"][k], v, rtol=1e-4, atol=1e-4, msg=k)
    resumed = run_ranks(4, _resume, str(tmp_path), timeout_s=400)
    for r, again in zip(results, resumed, strict=True):
        torch.testing.assert_close(torch.tensor(again), torch.tensor(r["after"]), rtol=0, atol=1e-5)


@pytest.mark.timeout(600)
def test_tp_over_every_rank_at_zero3_equals_one_rank() -> None:
    # data-parallel size 1: stage 3 partitions over a group of one inside a larger world
    (ref,) = run_ranks(1, _train, 1, None, timeout_s=240)
    for r in run_ranks(2, _train, 2, None, timeout_s=300):
        assert r["dp"] == 1
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=0, atol=1e-5)
        for k, v in ref["full"].items():
            torch.testing.assert_close(r["full"][k], v, rtol=1e-4, atol=1e-4, msg=k)
