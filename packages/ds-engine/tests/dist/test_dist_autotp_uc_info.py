"""A 2-rank AutoTP training save records DeepSpeed's `universal_checkpoint_info`, built from the layers' own
per-parameter records: the row-parallel, replicated and sub-parameter patterns name exactly the model's
row-parallel weights, its uncut trainable parameters, and the sections of its packed projection; frozen
parameters are left out. On each rank, DeepSpeed's restore helper (`_resolve_autotp_partition`) cuts every
gathered whole parameter back to exactly the shard the rank holds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ds_comm.testing import run_ranks

pytest.importorskip("ds_zero", reason="ZeRO saves need ds-zero: pip install 'ds-engine[zero]'")
pytest.importorskip("ds_parallel", reason="AutoTP needs ds-parallel: pip install 'ds-engine[parallel]'")


class Block(torch.nn.Module):
    """Column (`up_proj`), packed two-section (`gate_up_proj`) and row-parallel (`down_proj`) projections."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(6)
        self.up_proj = torch.nn.Linear(6, 10)
        self.gate_up_proj = torch.nn.Linear(6, 2 * 10)
        self.down_proj = torch.nn.Linear(10, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        gate, up = self.gate_up_proj(h).chunk(2, dim=-1)
        return x + self.down_proj(torch.nn.functional.silu(gate) * up + self.up_proj(h))


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _train_and_save(rank: int, world: int, save_dir: str) -> dict[str, Any]:
    import ds_comm
    import ds_engine
    from ds_engine.checkpoint.universal_checkpoint import _resolve_autotp_partition
    from ds_parallel import tensor

    torch.manual_seed(0)
    model = Model()
    model.layers[1].norm.weight.requires_grad_(False)  # type: ignore[union-attr]  # frozen: no optimizer state, so no pattern
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 1},
        "tensor_parallel": {"autotp_size": 2},
    }
    engine, *_ = ds_engine.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=cfg
    )
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        loss = torch.nn.functional.mse_loss(engine(torch.randn(4, 6, generator=g)), torch.randn(4, 3, generator=g))
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(save_dir, tag="t")
    mismatched = []
    for path, layer in tensor.tp_layers(engine.module).items():
        for pname in layer.layouts:
            param = getattr(layer, pname)
            whole = layer.full_tensor(pname)
            cut = _resolve_autotp_partition(param, {}, whole, tp_rank=layer.tp_index, tp_world_size=2)
            if cut is None or not torch.equal(cut, param.detach().flatten()):
                mismatched.append(f"{path}.{pname}")
    states = ds_comm.load_checkpoint_file(Path(save_dir) / "t" / f"mp_rank_{rank:02d}_model_states.pt")
    info = states["universal_checkpoint_info"]
    info.pop("affine_map", None)
    return {"info": info, "mismatched": mismatched}


def _names(patterns: list[str]) -> set[str]:
    return {p.removeprefix("^").removesuffix("$").replace("\\.", ".") for p in patterns}


@pytest.mark.timeout(600)
def test_autotp_save_records_deepspeed_universal_info(tmp_path: Path) -> None:
    results = run_ranks(2, _train_and_save, str(tmp_path), timeout_s=300)
    assert results[0]["info"] == results[1]["info"]  # every rank writes the same description
    info = results[0]["info"]
    assert [r["mismatched"] for r in results] == [[], []]
    blocks = ("layers.0", "layers.1")
    assert _names(info["parameter_with_row_parallelism_patterns"]) == {f"{b}.down_proj.weight" for b in blocks}
    assert _names(info["tp_replicated_parameter_patterns"]) == {
        "layers.0.norm.weight",
        "layers.0.norm.bias",
        "layers.1.norm.bias",
        "layers.0.down_proj.bias",
        "layers.1.down_proj.bias",
        "head.weight",
        "head.bias",
    }
    subs = {p: e for e in info["parameter_with_sub_params"] for p in _names(e["patterns"])}
    assert set(subs) == {f"{b}.gate_up_proj.{p}" for b in blocks for p in ("weight", "bias")}
    assert subs["layers.0.gate_up_proj.weight"]["shape"] == [(10, 10), 6]
    assert subs["layers.0.gate_up_proj.bias"]["partition_dim"] == 0
    assert info["sub_param_shard_widths"][r"^layers\.1\.gate_up_proj\.weight$"] == [[5, 5], [5, 5]]
    assert info["vocabulary_parameter_patterns"] == [] and info["autotp_unsupported_parameter_patterns"] == {}
    assert info["universal_checkpoint_version"] == 0.4
