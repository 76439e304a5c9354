"""Dynamic batching (variable batch size and lr) against DeepSpeed 0.19.8's recorded batches and lrs.

`fixtures/data_sampling/deepspeed_data_sampling.json` holds, per case of `data_sampling_cases.py`, what
DeepSpeed's `batch_by_seqlens` and `lr_scheduler_for_variable_batch_size` gave (see `make_fixture.py`).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from ds_engine._data.variable_batch import (
    batch_by_seqlens,
    get_dataloader_and_lr_scheduler_for_variable_batch_size,
    lr_scheduler_for_variable_batch_size,
    scale_lr,
)

FIXTURES = Path(__file__).parent / "fixtures" / "data_sampling"
sys.path.insert(0, str(FIXTURES))
import data_sampling_cases as cases  # noqa: E402

RECORDED = json.loads((FIXTURES / "deepspeed_data_sampling.json").read_text())["dynamic_batching"]


@pytest.mark.parametrize("name", sorted(cases.DYNAMIC_CASES))
def test_batches_and_lrs_equal_deepspeeds(name: str) -> None:
    case = cases.DYNAMIC_CASES[name]
    ids, sizes, max_lens = batch_by_seqlens(cases.SEQLENS, **case["batching"])
    want = RECORDED[name]
    assert [[b, [int(x) for x in mb]] for b, mb in ids] == want["microbatch_ids"]
    assert sizes == want["batch_sizes"]
    assert [int(x) for x in max_lens] == want["batch_max_seqlens"]
    # every micro batch within the limits, and the batch size is what the lr is scaled by
    for _, mb in ids:
        assert sum(cases.SEQLENS[i] for i in mb) <= case["batching"]["max_tokens"]

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=case["base_lr"])
    base = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5) if case["with_scheduler"] else opt
    sched = lr_scheduler_for_variable_batch_size(
        case["batching"]["effective_batch_size"], sizes, None, base, lr_scaling_method=case["method"]
    )
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(len(sizes) + 2):
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs == pytest.approx(want["lrs"], rel=1e-12, abs=0)


def test_lr_factor_against_the_formula() -> None:
    assert scale_lr(8, 4, 0.1, "linear") == pytest.approx(0.05)
    assert scale_lr(8, 32, 0.1, "sqrt") == pytest.approx(0.1 * math.sqrt(4))
    assert scale_lr(8, 32, 0.1, "none") == 0.1
    assert scale_lr(8, 32, 0.1, None) == 0.1
    with pytest.raises(ValueError, match="'cubic'"):
        scale_lr(8, 32, 0.1, "cubic")


def test_loader_yields_the_micro_batches_of_each_rank() -> None:
    data = [torch.full((n,), i) for i, n in enumerate(cases.SEQLENS)]
    ids, _, _ = batch_by_seqlens(cases.SEQLENS, max_tokens=40, effective_batch_size=2)
    opt = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=1.0)
    seen = []
    for rank in range(2):
        loader, _, io_kwargs = get_dataloader_and_lr_scheduler_for_variable_batch_size(
            data,
            cases.SEQLENS,
            40,
            2,
            dataloader_rank=rank,
            dataloader_num_replicas=2,
            lr_scheduler_or_optimizer=opt,
        )
        assert io_kwargs["data_sampler"] is loader.sampler
        got = [[int(s[0]) for s in batch] for batch in loader]
        assert got == [mb for k, (_, mb) in enumerate(ids) if k % 2 == rank]
        seen += got
    assert sorted(i for mb in seen for i in mb) == sorted(i for _, mb in ids for i in mb)


def test_bad_picking_order_and_too_few_samples_are_refused() -> None:
    with pytest.raises(ValueError, match="sequence_picking_order is 'longest'"):
        batch_by_seqlens([1, 2, 3], 10, sequence_picking_order="longest")
    with pytest.raises(ValueError, match="fewer than the 4 one batch needs"):
        batch_by_seqlens([5, 5, 5, 5], 5, effective_batch_size=4)


class _Seqs(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return len(cases.SEQLENS)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.ones(cases.SEQLENS[i], 3), i


def _collate(batch: list) -> tuple[torch.Tensor, torch.Tensor]:
    seqs, ids = zip(*batch, strict=False)
    return torch.nn.utils.rnn.pad_sequence(list(seqs), batch_first=True), torch.tensor(ids)


def test_engine_helper_scales_the_engines_lr_per_batch(tmp_path: Path) -> None:
    from ds_engine_testkit import make_engine

    from ds_engine.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr import (
        get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed,
    )

    config = {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}},
        "data_efficiency": {
            "enabled": True,
            "seed": 42,
            "data_sampling": {
                "dynamic_batching": {
                    "enabled": True,
                    "max_tokens": 40,
                    "lr_scaling_method": "linear",
                    "sequence_picking_order": "seqlen",
                    "max_batch_size": 6,
                    "metrics_path": str(tmp_path),
                },
            },
        },
    }
    engine = make_engine(torch.nn.Linear(3, 1), config)
    # the lengths come from the data analyzer's seqlen metric when not given (a single worker needs no process group)
    loader, sched, io_kwargs = get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(
        _Seqs(),
        engine,
        dataloader_collate_fn=_collate,
        batch_seqlens_fn=lambda batch: (batch[0][:, :, 0] != 0).sum(1),
    )
    ids, sizes, _ = batch_by_seqlens(
        cases.SEQLENS, 40, max_batch_size=6, sequence_picking_order="seqlen", effective_batch_size=4, seed=42
    )
    engine.lr_scheduler = sched
    it = iter(loader)
    consumed: list = []
    for k in range(len(sizes) - 1):
        # the lr of step k is the base lr scaled by batch k's sequence count over train_batch_size
        assert engine.optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * sizes[k] / 4)
        for _ in range(engine.gradient_accumulation_steps()):
            seqs, sample_ids = next(it)
            assert sample_ids.tolist() == [i for _, mb in ids[len(consumed) : len(consumed) + 2] for i in mb]
            consumed += ids[len(consumed) : len(consumed) + 2]
            engine.backward(engine(seqs.mean(1)).pow(2).mean())
            engine.step()
    assert io_kwargs["data_sampler"] is loader.sampler
    # DeepSpeed's other route: the engine's own loader from the returned kwargs gives the same batches
    via_engine = [ids.tolist() for _, ids in engine.deepspeed_io(**io_kwargs)]
    assert via_engine == [ids.tolist() for _, ids in loader]


def test_engine_helper_without_lengths_or_metrics_path_names_the_key() -> None:
    from ds_engine_testkit import make_engine

    from ds_engine.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr import (
        get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed,
    )

    config = {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}},
        "data_efficiency": {"data_sampling": {"dynamic_batching": {"enabled": True, "max_tokens": 40}}},
    }
    engine = make_engine(torch.nn.Linear(3, 1), config)
    with pytest.raises(ValueError, match=r"dynamic_batching\.metrics_path is required"):
        get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(_Seqs(), engine)
