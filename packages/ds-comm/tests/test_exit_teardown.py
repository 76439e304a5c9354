"""The exit hook frees process groups that only a reference cycle still holds (see `_exit_teardown`'s note).

A group freed by the interpreter's last collection, during finalization, takes gloo's worker threads down
with SIGABRT; the hook collects while the interpreter is whole, also when the script destroyed its groups
itself (so no default group is left for the hook to destroy).
"""

from __future__ import annotations

import gc
import sys
import weakref

import pytest
import torch.distributed as dist

from ds_comm import _exit_teardown


class _Cycle:
    """Stands in for a process group kept alive only by a reference cycle."""

    def __init__(self) -> None:
        self.me = self


def test_hook_collects_cycles_after_the_script_destroyed_its_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(sys, "last_value", raising=False)
    monkeypatch.delattr(sys, "last_exc", raising=False)
    assert not dist.is_initialized()
    gc.disable()  # only the hook's own collection may free the cycle
    try:
        held = _Cycle()
        alive = weakref.ref(held)
        del held
        assert alive() is not None
        _exit_teardown._destroy_at_exit()
        assert alive() is None
    finally:
        gc.enable()


def test_hook_collects_after_an_uncaught_exception_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "last_value", RuntimeError("the script failed"), raising=False)
    calls = []
    monkeypatch.setattr(_exit_teardown, "collect_unreachable_groups", lambda: calls.append(1))
    limits = []
    monkeypatch.setattr(
        _exit_teardown, "_start_watchdog", lambda limit, failed: limits.append((limit, failed)) or (lambda: None)
    )
    _exit_teardown._destroy_at_exit()
    assert calls == [1]
    assert limits == [(_exit_teardown.EXCEPTION_TEARDOWN_LIMIT_S, True)]
