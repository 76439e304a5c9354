"""How long a shared-memory p2p wait polls before it sleeps: only where every local rank has a CPU."""

from __future__ import annotations

import os

import pytest
import torch

from ds_comm import _shm_p2p


def test_polls_where_every_local_rank_has_a_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_shm_p2p.POLL_ENV, raising=False)
    cpus = len(os.sched_getaffinity(0))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cpus))
    assert _shm_p2p.poll_seconds() == pytest.approx(_shm_p2p.DEFAULT_POLL_US / 1e6)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cpus + 1))  # more ranks than CPUs: polling takes compute time
    assert _shm_p2p.poll_seconds() == 0.0
    monkeypatch.delenv("LOCAL_WORLD_SIZE")  # unknown: do not poll
    assert _shm_p2p.poll_seconds() == 0.0
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setattr(torch, "get_num_threads", lambda: cpus + 1)  # its own threads would lose a CPU
    assert _shm_p2p.poll_seconds() == 0.0


def test_the_variable_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1000")
    monkeypatch.setenv(_shm_p2p.POLL_ENV, "250")
    assert _shm_p2p.poll_seconds() == pytest.approx(250e-6)
    monkeypatch.setenv(_shm_p2p.POLL_ENV, "0")
    assert _shm_p2p.poll_seconds() == 0.0


@pytest.mark.parametrize("raw", ["soon", "-1", "2e6"])
def test_a_bad_value_names_the_variable(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(_shm_p2p.POLL_ENV, raw)
    with pytest.raises(ValueError, match=f"DS_COMM_SHM_POLL_US='{raw}'"):
        _shm_p2p.poll_seconds()
