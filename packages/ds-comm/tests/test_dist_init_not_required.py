"""`init_distributed(dist_init_required=False)`: skipping the group is fine for a single process, but in a
launched job of several ranks (WORLD_SIZE > 1) with no group it is a UsageError (DeepSpeed asserts), not a
silent world of one per rank."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import ds_comm


def test_not_required_in_a_single_process_creates_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ds_comm.init_distributed(dist_init_required=False)
    assert not dist.is_initialized()


def test_not_required_in_a_launched_job_without_a_group_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(
        ds_comm.UsageError, match="dist_init_required=False, but no process group exists and WORLD_SIZE=4"
    ):
        ds_comm.init_distributed(dist_init_required=False)
    assert not dist.is_initialized()
