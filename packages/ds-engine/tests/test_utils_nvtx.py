"""`deepspeed.utils.nvtx.instrument_w_nvtx`: one profiler range per call, named after the function."""

from __future__ import annotations

from typing import Any

import pytest

from ds_engine.utils import nvtx


class _DomainAccelerator:
    supports_nvtx_domain = True

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def range_push(self, msg: str, domain: Any = None, category: Any = None) -> None:
        self.calls.append(("push", msg, domain))

    def range_pop(self, domain: Any = None) -> None:
        self.calls.append(("pop", domain))


class _PlainAccelerator:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def range_push(self, msg: str) -> None:
        self.calls.append(("push", msg))

    def range_pop(self) -> None:
        self.calls.append(("pop",))


def _double(x: int) -> int:
    return 2 * x


def _fails() -> None:
    raise RuntimeError("boom")


@pytest.fixture
def accelerator(monkeypatch: pytest.MonkeyPatch) -> _DomainAccelerator:
    fake = _DomainAccelerator()
    monkeypatch.setattr(nvtx, "get_accelerator", lambda: fake)
    return fake


def test_range_in_the_deepspeed_domain(accelerator: _DomainAccelerator) -> None:
    wrapped = nvtx.instrument_w_nvtx(_double)
    assert wrapped(21) == 42
    assert wrapped.__name__ == "_double"
    assert accelerator.calls == [("push", "_double", "DeepSpeed"), ("pop", "DeepSpeed")]


def test_accelerator_without_domains(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _PlainAccelerator()
    monkeypatch.setattr(nvtx, "get_accelerator", lambda: fake)
    assert nvtx.instrument_w_nvtx(_double)(1) == 2
    assert fake.calls == [("push", "_double"), ("pop",)]


def test_range_closes_when_the_function_raises(accelerator: _DomainAccelerator) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        nvtx.instrument_w_nvtx(_fails)()
    assert [c[0] for c in accelerator.calls] == ["push", "pop"]


def test_disabled_or_compiling_records_nothing(
    accelerator: _DomainAccelerator, monkeypatch: pytest.MonkeyPatch
) -> None:
    wrapped = nvtx.instrument_w_nvtx(_double)
    monkeypatch.setattr(nvtx, "enable_nvtx", False)
    assert wrapped(3) == 6
    monkeypatch.setattr(nvtx, "enable_nvtx", True)
    monkeypatch.setattr(nvtx, "is_compiling", lambda: True)
    assert wrapped(4) == 8
    assert accelerator.calls == []


def test_real_cpu_accelerator_runs_the_function() -> None:
    assert nvtx.instrument_w_nvtx(_double)(5) == 10
