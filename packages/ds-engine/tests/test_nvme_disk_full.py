"""ZeRO-Infinity on a disk that fills up mid-training: a clear error naming the swap directory, and the last
checkpoint (on the same disk) still loads.

The swap files and the checkpoints share a small tmpfs. After a checkpoint, a filler file takes the rest
of the disk; the first step (whose gradients and Adam state get new swap files) must fail with
`NVMeSwapError` naming the swap file under `nvme_path`, a checkpoint attempted then must fail without
touching the good one, and a fresh engine must load the good checkpoint and continue like a run that
never met the full disk. (Swap files already written are rewritten in place: once every file exists,
training goes on on a full disk, and only new checkpoints fail.)
"""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ds_comm.testing import run_ranks

ds_zero = pytest.importorskip("ds_zero", reason="NVMe offload needs ds-zero: pip install 'ds-engine[zero]'")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 64), nn.Tanh(), nn.Linear(64, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _config(nvme: str) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "sub_group_size": 4096,
            "offload_param": {"device": "nvme", "nvme_path": nvme, "buffer_count": 4, "buffer_size": 8192},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme},
        },
    }


def _step(engine: Any, step: int) -> float:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(4, 64, generator=g), torch.randn(4, 4, generator=g)
    loss = nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    return loss.item()


def _fill(path: Path) -> None:
    """Write zeros into `path` until the file system is full."""
    chunk = b"\0" * (64 << 10)
    with open(path, "wb", buffering=0) as f:
        while True:
            try:
                f.write(chunk)
            except OSError as err:
                if err.errno != errno.ENOSPC:
                    raise
                break
    for size in (4096, 1):  # the last partial pages too
        try:
            with open(path, "ab", buffering=0) as f:
                while True:
                    f.write(b"\0" * size)
        except OSError as err:
            if err.errno != errno.ENOSPC:
                raise


def _run(rank: int, world: int, disk: str, elsewhere: str) -> dict[str, Any]:
    import ds_engine as deepspeed

    root = Path(disk)
    (root / "swap").mkdir()
    (root / "swap2").mkdir()
    torch.manual_seed(0)
    ref, *_ = deepspeed.initialize(model=Net(), config=_config(elsewhere))  # swaps on the roomy disk
    out: dict[str, Any] = {"reference": [_step(ref, step) for step in range(2)]}
    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=Net(), config=_config(str(root / "swap")))
    engine.save_checkpoint(str(root / "ckpt"), tag="good")
    # Adam's state and the gradients get their swap files at the first step: there is no room left for them
    filler = root / "filler"
    _fill(filler)
    try:
        _step(engine, 0)
        out["step_error"] = ""
    except ds_zero.NVMeSwapError as err:
        out["step_error"] = str(err)
    try:
        engine.save_checkpoint(str(root / "ckpt"), tag="bad")
        out["save_error"] = ""
    except Exception as err:  # noqa: BLE001 - whatever the save raises, it must raise
        out["save_error"] = f"{type(err).__name__}: {err}"
    out["latest"] = (root / "ckpt" / "latest").read_text().strip()
    filler.unlink()
    torch.manual_seed(1)
    fresh, *_ = deepspeed.initialize(model=Net(), config=_config(str(root / "swap2")))
    path, _client = fresh.load_checkpoint(str(root / "ckpt"))
    out["loaded"] = path
    out["continued"] = [_step(fresh, step) for step in range(2)]
    return out


def test_a_full_disk_mid_training_names_the_swap_dir_and_keeps_the_last_checkpoint(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("tmpfs mounts are not available here")
    try:
        out = run_ranks(1, _run, disk=str(disk), elsewhere=str(tmp_path), timeout_s=120)[0]
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
    swap = str(disk / "swap" / "zero_stage_3" / "rank0")
    assert swap in out["step_error"] and "failed" in out["step_error"] and "disk full" in out["step_error"]
    assert out["save_error"], "a checkpoint on a full disk must fail, not half-write"
    assert out["latest"] == "good"
    assert out["loaded"] is not None and "/good/" in out["loaded"]
    assert out["continued"] == pytest.approx(out["reference"], rel=1e-6, abs=0)
