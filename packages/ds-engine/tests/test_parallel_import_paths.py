"""DeepSpeed's sequence-parallel and MoE import paths under ds_engine give ds-parallel's own objects, and name the
`parallel` extra when ds-parallel is missing."""

from __future__ import annotations

import importlib
import sys

import pytest

import ds_engine

SHIMS = (
    "ds_engine.sequence.layer",
    "ds_engine.sequence",
    "ds_engine.runtime.sequence_parallel.ulysses_sp",
    "ds_engine.runtime.sequence_parallel.parallel_state_sp",
    "ds_engine.utils.groups",
    "ds_engine._parallel.groups",  # the module the DeepSpeed path above is
    "ds_engine.moe",
    "ds_engine.moe.layer",
    "ds_engine.moe.utils",
    "ds_engine.moe.sharded_moe",
    "ds_engine.moe.experts",
)


@pytest.fixture
def fresh_shims():
    """Drop the shims before and after, so they bind to this test's (real or missing) ds-parallel."""

    def drop() -> None:
        for name in SHIMS:
            sys.modules.pop(name, None)
        ds_engine.__dict__.pop("sequence", None)
        ds_engine.__dict__.pop("moe", None)

    drop()
    yield
    drop()


def test_paths_give_ds_parallels_objects(fresh_shims) -> None:
    ds_parallel = pytest.importorskip("ds_parallel", reason="needs ds-parallel: pip install 'ds-engine[parallel]'")
    from ds_engine.runtime.sequence_parallel import parallel_state_sp as ps_shim
    from ds_engine.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    from ds_engine.sequence.layer import DistributedAttention
    from ds_engine.utils import groups as groups_shim
    from ds_parallel import groups, parallel_state_sp, ulysses_sp

    assert DistributedAttention is ds_parallel.DistributedAttention
    assert ds_engine.sequence.DistributedAttention is ds_parallel.DistributedAttention
    assert UlyssesSPAttentionHF is ulysses_sp.UlyssesSPAttentionHF
    assert UlyssesSPDataLoaderAdapter is ulysses_sp.UlyssesSPDataLoaderAdapter
    assert ds_engine.runtime.sequence_parallel.ulysses_sp.TiledMLP is ulysses_sp.TiledMLP
    assert ps_shim.initialize_sequence_parallel is parallel_state_sp.initialize_sequence_parallel
    assert groups_shim._get_sequence_parallel_group is groups._get_sequence_parallel_group


def test_moe_paths_give_ds_parallels_objects(fresh_shims) -> None:
    pytest.importorskip("ds_parallel", reason="needs ds-parallel: pip install 'ds-engine[parallel]'")
    from ds_engine.moe.experts import Experts
    from ds_engine.moe.layer import MoE
    from ds_engine.moe.sharded_moe import MOELayer, TopKGate, top1gating
    from ds_engine.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer
    from ds_parallel import moe

    assert MoE is moe.MoE and ds_engine.moe.MoE is moe.MoE and Experts is moe.Experts
    assert (MOELayer, TopKGate, top1gating) == (moe.MOELayer, moe.TopKGate, moe.top1gating)
    assert is_moe_param is moe.is_moe_param
    assert (
        split_params_into_different_moe_groups_for_optimizer is moe.split_params_into_different_moe_groups_for_optimizer
    )


@pytest.mark.parametrize("path", SHIMS)
def test_missing_ds_parallel_names_the_extra(path: str, monkeypatch, fresh_shims) -> None:
    monkeypatch.setitem(sys.modules, "ds_parallel", None)  # import ds_parallel -> ModuleNotFoundError
    with pytest.raises(ImportError, match=r"needs ds-parallel: pip install 'ds-engine\[parallel\]'"):
        importlib.import_module(path)
