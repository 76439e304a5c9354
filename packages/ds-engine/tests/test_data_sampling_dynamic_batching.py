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
            data, cases.SEQLENS, 40, 2, dataloader_rank=rank, dataloader_num_replicas=2,
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
