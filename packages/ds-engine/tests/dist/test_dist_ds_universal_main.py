"""DeepSpeed's conversion entry point end to end: a real AutoTP save, `main(namespace)`, restore at TP=3.

A tiny HF Llama with 6 heads trains 2 steps with Adam at TP=2 (3 heads per rank) under ZeRO 1 on two
gloo ranks and saves. `deepspeed.checkpoint.ds_to_universal.main`
(ds_engine's, given DeepSpeed's argument namespace) converts the save: every parameter's `fp32` must be the
unsharded weight the engine saved whole (`module` of the model-states file), exactly. Then each projection
and the output head are rebuilt at another degree, TP=3 (2 heads per rank; the 96-row head 32 rows each),
as AutoTP layers built over the unsharded model (what a TP=3 job
holds), and `load_hp_checkpoint_state` fills each rank's fragment from the universal folder: every rank's
piece must be the layer's own shard of the saved weight, and the three pieces put back together the whole.
Needs ds-zero, ds-parallel and transformers.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from ds_comm.testing import run_ranks

pytest.importorskip("ds_zero", reason="universal checkpoints need ds-zero: pip install 'ds-engine[zero]'")
tensor = pytest.importorskip("ds_parallel", reason="AutoTP needs ds-parallel: pip install 'ds-engine[parallel]'").tensor
pytest.importorskip("transformers")

from tiny_hf_models import batch, build  # noqa: E402

TAG = "global_step2"
SHAPE = {"heads": 6, "kv_heads": 6, "hidden": 48}


def _train_and_save(rank: int, world: int, save_dir: str) -> None:
    import ds_engine

    model = build("llama", **SHAPE)
    model.train()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 1},
        "tensor_parallel": {"autotp_size": world},
    }
    engine, *_ = ds_engine.initialize(model=model, config=config)
    attn = engine.module.model.layers[0].self_attn
    assert attn.k_proj.weight.shape[0] == 24  # 6 heads of 8 rows over 2 ranks
    for step in range(2):
        ids = batch(seed=step, size=2, seq=8)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.save_checkpoint(save_dir)


class _Fragment:
    """DeepSpeed's `_hp_mapping` over a whole rank shard."""

    def __init__(self, numel: int) -> None:
        self.lp_fragment_address = SimpleNamespace(start=0, numel=numel)
        self.hp = torch.zeros(numel)
        self.optim_fragment: dict[str, torch.Tensor] = {}

    def get_hp_fragment(self) -> torch.Tensor:
        return self.hp


def _as_tp3(layer: Any, rank: int, total: int) -> Any:
    layer.tp_world_size, layer.tp_index = 3, rank
    layer._freeze_partition_sizes(total)
    layer._mark_uc_metadata()
    return layer


def test_autotp_save_converts_through_main_and_restores_at_another_degree(tmp_path: Path) -> None:
    import ds_comm
    from ds_engine.checkpoint import ds_to_universal
    from ds_engine.checkpoint.universal_checkpoint import load_hp_checkpoint_state

    run_ranks(2, _train_and_save, str(tmp_path), timeout_s=300)
    universal = tmp_path / f"{TAG}_universal"
    args = SimpleNamespace(
        input_folder=str(tmp_path / TAG),
        output_folder=str(universal),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=False,
    )
    assert ds_to_universal.main(args) is None
    module = ds_comm.load_checkpoint_file(tmp_path / TAG / "mp_rank_00_model_states.pt")["module"]
    for name, value in module.items():
        stored = ds_comm.load_checkpoint_file(universal / "zero" / name / "fp32.pt")
        assert torch.equal(stored["param"], value.float()), name

    meta = tensor.TPMeta(num_kv_heads=6, num_attention_heads=6, hidden_size=48)
    cuts = {
        "model.layers.0.self_attn.q_proj": (tensor.LinearLayer, "self_attn.q_proj", 0),
        "model.layers.0.self_attn.k_proj": (tensor.LinearLayer, "self_attn.k_proj", 0),
        "model.layers.1.self_attn.o_proj": (tensor.LinearAllreduce, "self_attn.o_proj", 1),
        "lm_head": (tensor.LinearLayer, "lm_head", 0),
    }
    for path, (kind, layer_name, cut) in cuts.items():
        name = f"{path}.weight"
        whole = module[name].float()
        pieces = []
        for rank in range(3):
            plain = nn.Linear(whole.shape[1], whole.shape[0], bias=False)
            with torch.no_grad():
                plain.weight.copy_(whole)
            layer = _as_tp3(kind(plain, None, name=layer_name, tp_meta=meta), rank, whole.shape[cut])
            param = layer.weight
            param._hp_mapping = _Fragment(layer.layouts["weight"].shard(whole, rank).numel())  # type: ignore[attr-defined]
            load_hp_checkpoint_state(param, str(universal / "zero" / name), rank, 3)
            expected = layer.layouts["weight"].shard(whole, rank)
            got = param._hp_mapping.hp.view(expected.shape)  # type: ignore[attr-defined]
            assert torch.equal(got, expected), (name, rank)
            assert "exp_avg" in param._hp_mapping.optim_fragment  # type: ignore[attr-defined]
            pieces.append(got)
        assert [p.shape[cut] for p in pieces] == [whole.shape[cut] // 3] * 3
        assert torch.equal(torch.cat(pieces, dim=cut), whole), name
