"""The data analyzer and the curriculum sampler against DeepSpeed 0.19.8's recorded outputs.

`fixtures/data_sampling/deepspeed_data_sampling.json` was written by `make_fixture.py` there, run with DeepSpeed
0.19.8, over the dataset, metrics and configs of `data_sampling_cases.py`.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ds_engine._data.analyzer import DataAnalyzer
from ds_engine._data.indexed_dataset import MMapIndexedDataset
from ds_engine._data.sampler import DeepSpeedDataSampler

FIXTURES = Path(__file__).parent / "fixtures" / "data_sampling"
sys.path.insert(0, str(FIXTURES))
import data_sampling_cases as cases  # noqa: E402

RECORDED = json.loads((FIXTURES / "deepspeed_data_sampling.json").read_text())


def _sha256(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


def _analyze(root: Path, **override) -> None:
    kw = cases.analyzer_kwargs(torch, **override)
    for worker in range(kw["num_workers"]):
        DataAnalyzer(cases.MetricDataset(), worker_id=worker, save_path=str(root), **kw).run_map()
    DataAnalyzer(cases.MetricDataset(), worker_id=0, save_path=str(root), **kw).run_reduce()


@pytest.fixture(scope="module")
def analysis(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("analysis")
    _analyze(root)
    return root


def test_analyzer_writes_deepspeeds_files_byte_for_byte(analysis: Path) -> None:
    ours = _sha256(analysis)
    theirs = RECORDED["analyzer_sha256"]
    assert sorted(ours) == sorted(theirs)
    differing = [name for name in theirs if ours[name] != theirs[name]]
    assert differing == []


def test_single_process_analysis_equals_the_multi_worker_one(analysis: Path, tmp_path: Path) -> None:
    _analyze(tmp_path, num_workers=1, num_threads=1, num_threads_reduce=1)
    for metric in ("seqlen", "vocab"):
        for kind in ("sample_to_metric", "index_to_sample", "index_to_metric", "index_to_sample_percentile_merged"):
            name = f"{metric}/{metric}_{kind}"
            single = MMapIndexedDataset(str(tmp_path / name), skip_warmup=True)
            multi = MMapIndexedDataset(str(analysis / name), skip_warmup=True)
            assert (tmp_path / f"{name}.bin").read_bytes() == (analysis / f"{name}.bin").read_bytes(), name
            assert [r.tolist() for r in single] == [r.tolist() for r in multi], name
    assert (tmp_path / "total/total_metric_value.bin").read_bytes() == (
        analysis / "total/total_metric_value.bin"
    ).read_bytes()
    # and against plain numpy on the same data
    seqlen = np.array(cases.SEQLEN)
    s2m = MMapIndexedDataset(str(tmp_path / "seqlen/seqlen_sample_to_metric"), skip_warmup=True)
    assert np.concatenate(list(s2m)).tolist() == seqlen.tolist()
    i2m = MMapIndexedDataset(str(tmp_path / "seqlen/seqlen_index_to_metric"), skip_warmup=True)
    i2s = MMapIndexedDataset(str(tmp_path / "seqlen/seqlen_index_to_sample"), skip_warmup=True)
    values = sorted(set(cases.SEQLEN))
    assert [int(r[0]) for r in i2m] == values
    assert [r.tolist() for r in i2s] == [np.flatnonzero(seqlen == v).tolist() for v in values]
    total = MMapIndexedDataset(str(tmp_path / "total/total_metric_value"), skip_warmup=True)
    assert total[0].tolist() == [sum(cases.SEQLEN), sum(cases.VOCAB)]


def test_analyzer_refuses_a_metric_of_the_wrong_dtype(tmp_path: Path) -> None:
    kw = cases.analyzer_kwargs(torch, num_workers=1, num_threads=1, num_threads_reduce=1)
    kw["metric_dtypes"] = [torch.int32, torch.int64, torch.int64]
    with pytest.raises(TypeError, match="metric_dtypes entry is torch.int32"):
        DataAnalyzer(cases.MetricDataset(), save_path=str(tmp_path), **kw).run_map()
    with pytest.raises(ValueError, match="metric_types for 'seqlen' is 'per_sample'"):
        DataAnalyzer(
            cases.MetricDataset(), metric_names=["seqlen"], metric_functions=[len], metric_types=["per_sample"]
        )


def _sampler(name: str, root: Path, dp_rank: int = 0, dp_size: int = 1) -> DeepSpeedDataSampler:
    from ds_engine.config import DeepSpeedConfig

    case = cases.SAMPLER_CASES[name]
    section = cases.sampler_config(name, case, str(root))
    mbs = case["micro_batch_size"]
    cfg = {
        "train_micro_batch_size_per_gpu": mbs,
        "gradient_accumulation_steps": case["gradient_accumulation_steps"],
        "data_efficiency": section,
    }
    de = DeepSpeedConfig(cfg).data_efficiency_config
    sampler = DeepSpeedDataSampler(
        de, cases.NUM_SAMPLES, mbs, dp_rank, dp_size, None, case["gradient_accumulation_steps"], dp_rank
    )
    if "custom" in case:
        sampler.set_custom_curriculum_learning_schedule({m: cases.CUSTOM[c] for m, c in case["custom"].items()})
    return sampler


@pytest.mark.parametrize("name", sorted(cases.SAMPLER_CASES))
def test_sampler_order_equals_deepspeeds(name: str, analysis: Path) -> None:
    assert [list(mb) for mb in _sampler(name, analysis)] == RECORDED["sampler"][name]


def test_sampler_resumes_where_its_state_left_off(analysis: Path) -> None:
    name = "value_fixed_linear"
    whole = [list(mb) for mb in _sampler(name, analysis)]
    first = _sampler(name, analysis)
    it = iter(first)
    head = [next(it) for _ in range(23)]
    state = first.state_dict()
    resumed = _sampler(name, analysis)
    resumed.load_state_dict(state)
    assert head + [list(mb) for mb in resumed] == whole


def test_distributed_analyzer_threads_map_like_one_thread() -> None:
    from ds_engine._data.distributed_analyzer import DistributedDataAnalyzer

    kw = cases.analyzer_kwargs(torch)
    for key in ("metric_dtypes", "num_threads_reduce", "num_workers", "num_threads"):
        kw.pop(key)
    one = DistributedDataAnalyzer(cases.MetricDataset(), num_workers=2, worker_id=1, num_threads=1, **kw)._map()
    three = DistributedDataAnalyzer(cases.MetricDataset(), num_workers=2, worker_id=1, num_threads=3, **kw)._map()
    assert one[0] == three[0] == [(cases.SEQLEN[i], i) for i in range(60, 120)]
    assert one[1] == three[1]
    assert one[2].tolist() == three[2].tolist() == [sum(cases.SEQLEN[60:]), sum(cases.VOCAB[60:])]


def test_a_deepspeed_sampler_state_loads_and_resumes_as_in_deepspeed(analysis: Path) -> None:
    recorded = json.loads((FIXTURES / "deepspeed_data_sampling.json").read_text())["sampler_resume"]
    state = dict(recorded["state"])
    kind, keys, pos, has_gauss, cached = state["np_rng_state"]
    state["np_rng_state"] = (kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached)
    name = "value_fixed_linear"
    first = _sampler(name, analysis)  # writes the cluster files as they were when DeepSpeed's state was saved
    it = iter(first)
    for _ in range(23):
        next(it)
    resumed = _sampler(name, analysis)
    resumed.load_state_dict(state)  # no sampler_rng_state: the stream restarts from the seed, as DeepSpeed's does
    assert [list(mb) for mb in resumed] == recorded["after_load"]
