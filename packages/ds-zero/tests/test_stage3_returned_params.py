"""Parameters returned from a forward, in one process: where they are found, evaluation, the root's return.

The search through outputs (`returned_params`) covers the containers users return; evaluation without
an optimizer keeps a parameter returned inside a plain object for the caller and equals plain torch
exactly; a parameter the whole model returns stays whole until its backward is done and trains like
plain torch (fp32, 1e-6). The multi-rank training cases are in `dist/test_dist_stage3_returned_params.py`.
"""

from __future__ import annotations

import collections
import copy
import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

import ds_zero
from ds_zero import ZeroParamStatus
from ds_zero._schedule.returned_params import returned_params

CFG = {"stage": 3, "param_persistence_threshold": 0, "prefetch_bucket_size": 0}


class Holder:
    """A plain object (no pytree, no dataclass), as DeepSpeed's own test returns."""

    def __init__(self, out: torch.Tensor, weight: nn.Parameter) -> None:
        self.out = out
        self.weight = weight


@dataclasses.dataclass
class Pair:
    first: object
    second: object


class Output(collections.OrderedDict):
    """Shaped like Hugging Face's `ModelOutput` (an OrderedDict subclass)."""


def _partitioned(*shapes: tuple[int, ...]) -> list[nn.Parameter]:
    module = nn.ParameterList([nn.Parameter(torch.randn(*s)) for s in shapes])
    ds_zero.DeepSpeedZeRoOffload(module, config=CFG)
    return list(module)


def test_returned_params_searches_the_usual_containers() -> None:
    a, b, c, d, e = _partitioned((2, 3), (4,), (3, 3), (5,), (2, 2))
    plain = nn.Parameter(torch.ones(2))  # not partitioned: not ours to keep
    out = (
        torch.zeros(1),
        [a, {"x": b, "y": "text"}],
        Pair(Holder(torch.zeros(1), c), Output(w=d)),
        plain,
        a,
    )
    assert [p.ds_id for p in returned_params(out)] == [p.ds_id for p in (a, b, c, d)]
    assert returned_params(e) == [e]
    assert returned_params(torch.zeros(3)) == []
    assert returned_params(None) == []
    deep: object = e
    for _ in range(6):
        deep = [deep]
    assert returned_params(deep) == []  # past the depth limit: outputs are shallow, caches are not searched


class Projector(nn.Linear):
    """Returns its weight in a plain object; the caller applies it."""

    def forward(self, x: torch.Tensor) -> Holder:  # type: ignore[override]
        return Holder(torch.relu(super().forward(x)), self.weight)


class Reuser(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = Projector(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        held = self.proj(x)
        return self.head(held.out @ held.weight)


def test_evaluation_keeps_a_returned_weight_for_the_caller() -> None:
    torch.manual_seed(0)
    ref = Reuser()
    model = copy.deepcopy(ref)
    ds_zero.DeepSpeedZeRoOffload(model, config=CFG)
    x = torch.randn(4, 6)
    with torch.no_grad():
        for _ in range(3):  # recording, then replaying the evaluation order
            torch.testing.assert_close(model(x), ref(x), atol=0, rtol=0)
            assert all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in model.parameters())
    assert list(model._external_params.values()) == [model.proj.weight]
    assert model.proj._external_params == {}


class ReturnsWeight(nn.Module):
    """The whole model returns a parameter: the training loop adds a penalty on it."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(5, 5)
        self.out = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, nn.Parameter]:
        return self.out(torch.tanh(self.inner(x))), self.inner.weight


def test_a_parameter_the_model_returns_stays_whole_through_backward() -> None:
    torch.manual_seed(0)
    ref = ReturnsWeight()
    model = copy.deepcopy(ref)
    opt = ds_zero.DeepSpeedZeroOptimizer_Stage3(model, torch.optim.SGD(model.parameters(), lr=0.1), config=CFG)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(3, 5, generator=g), torch.randint(0, 2, (3,), generator=g)
        logits, weight = model(x)
        assert weight.ds_status is ZeroParamStatus.AVAILABLE
        loss = F.cross_entropy(logits, y) + 0.1 * weight.pow(2).sum()
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        assert all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in model.parameters())
        ref_logits, ref_weight = ref(x)
        ref_loss = F.cross_entropy(ref_logits, y) + 0.1 * ref_weight.pow(2).sum()
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(loss.detach(), ref_loss.detach(), atol=1e-6, rtol=1e-5)
    with ds_zero.GatheredParameters(list(model.parameters())):
        for p, r in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, r, atol=1e-6, rtol=1e-5)
