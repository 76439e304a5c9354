"""NVMe offload (ZeRO-Infinity) in one process: training equals no offload, and every fault is a clear error.

Faults: a missing, non-directory or read-only `nvme_path` (before anything is partitioned); a full disk
(a small tmpfs, at construction and at the step where it fills up; RLIMIT_FSIZE -> EFBIG for the
unprivileged case); a truncated or overwritten swap file between steps (at the next swap-in, naming the file
and the tensor); buffers too small for a shard or for the optimizer's state.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ds_zero
from ds_comm.testing import run_ranks
from ds_zero._params.partitioned_param import is_zero_param, state_of


class Net(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)
        self.head = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def _cfg(path: Path | None, *, param: bool = True, opt: bool = True, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "stage": 3,
        "stage3_param_persistence_threshold": 100,
        "sub_group_size": 4096,
        "stage3_prefetch_bucket_size": 9000,
    }
    if param:
        cfg["offload_param"] = {
            "device": "nvme",
            "nvme_path": str(path),
            "buffer_count": 4,
            "buffer_size": 8192,
            "max_in_cpu": 0,
        }
    if opt:
        cfg["offload_optimizer"] = {
            "device": "nvme",
            "nvme_path": str(path),
            "pipeline_read": True,
            "pipeline_write": True,
        }
    cfg.update(extra)
    return cfg


def _build(
    cfg: dict[str, Any], seed: int = 0, width: int = 64, adam: type[torch.optim.Optimizer] = torch.optim.AdamW
) -> tuple[Net, Any]:
    torch.manual_seed(seed)
    model = Net(width)
    base = adam(model.parameters(), lr=1e-2, weight_decay=0.01)
    return model, ds_zero.DeepSpeedZeroOptimizer_Stage3(model, base, config=cfg, clip_grad=1.0)


def _train(model: nn.Module, opt: Any, steps: int, start: int = 0, width: int = 64) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(6, width, generator=g), torch.randn(6, 8, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _files(root: Path, kind: str) -> list[Path]:
    return sorted((root / "zero_stage_3" / "rank0").glob(f"{kind}*/*.swp"))


def test_nvme_training_equals_no_offload_and_checkpoints_load_either_way(tmp_path: Path) -> None:
    ref_model, ref_opt = _build(_cfg(None, param=False, opt=False))
    model, opt = _build(_cfg(tmp_path))
    assert len(_files(tmp_path, "params")) == 4 and len(_files(tmp_path, "optimizer")) == len(opt.tiles) > 1
    assert all(p.ds_tensor.stride() == (0,) for p in (model.fc1.weight, model.fc2.weight))  # swapped out
    ref = _train(ref_model, ref_opt, 5)
    got = _train(model, opt, 5)
    # The NVMe run's gradient norm (for clipping) is summed tile by tile as the swapped gradients are
    # written, the in-memory one over the whole partition: equal up to fp32 rounding of the sum.
    assert got == pytest.approx(ref, rel=1e-6, abs=0)
    full = ds_zero.consolidated_16bit_state_dict(model, rank0_only=False)
    for key, value in ds_zero.consolidated_16bit_state_dict(ref_model, rank0_only=False).items():
        torch.testing.assert_close(full[key], value, rtol=1e-5, atol=1e-6)
    # the optimizer state went to disk: only placeholders in memory between steps
    state = opt.optimizer.state[opt.tiles[0].master]
    assert state["exp_avg"].stride() == (0,) and opt.optimizer_swapper.num_writes > 0
    # checkpoint of the nvme run -> a run without offload, and back into a fresh nvme run
    ds_zero.save_zero_checkpoint(tmp_path / "ckpt", "s5", opt, model)
    plain_model, plain_opt = _build(_cfg(None, param=False, opt=False), seed=1)
    ds_zero.load_zero_checkpoint(tmp_path / "ckpt", plain_opt, plain_model)
    nvme_model, nvme_opt = _build(_cfg(tmp_path / "ckpt"), seed=2)
    ds_zero.load_zero_checkpoint(tmp_path / "ckpt", nvme_opt, nvme_model)
    cont = _train(model, opt, 3, start=5)
    assert _train(plain_model, plain_opt, 3, start=5) == pytest.approx(cont, rel=1e-6, abs=0)
    assert _train(nvme_model, nvme_opt, 3, start=5) == cont
    fp32 = ds_zero.get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt")
    for key, value in full.items():
        torch.testing.assert_close(fp32[key], value, rtol=0, atol=0)


@pytest.mark.parametrize("where", ["offload_param", "offload_optimizer"])
def test_missing_or_non_directory_nvme_path_fails_before_partitioning(tmp_path: Path, where: str) -> None:
    regular = tmp_path / "a_file"
    regular.write_text("x")
    cases = [
        (tmp_path / "missing", "the directory does not exist"),
        (regular, "it is not a directory"),
        (regular / "below", "the directory does not exist"),
    ]
    for path, reason in cases:
        cfg = _cfg(tmp_path)
        cfg[where]["nvme_path"] = str(path)
        model = Net()
        base = torch.optim.AdamW(model.parameters())
        with pytest.raises(ValueError, match=rf"zero_optimization\.{where}\.nvme_path='{path}': {reason}"):
            ds_zero.DeepSpeedZeroOptimizer_Stage3(model, base, config=cfg)
        if where == "offload_param":  # nothing was partitioned
            assert not any(is_zero_param(p) for p in model.parameters())


def _mount_tmpfs(path: Path, options: str) -> bool:
    path.mkdir(exist_ok=True)
    if os.geteuid() != 0:
        return False
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    return done.returncode == 0


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Any]:
    mounted: list[Path] = []

    def mount(name: str, options: str) -> Path:
        path = tmp_path / name
        if not _mount_tmpfs(path, options):
            pytest.skip("needs root and tmpfs mounts (the RLIMIT_FSIZE test covers the unprivileged case)")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", str(path)], capture_output=True)


def test_read_only_nvme_path_is_refused(tmpfs: Any) -> None:
    path = tmpfs("ro", "ro,size=1m")
    with pytest.raises(
        ValueError,
        match=r"offload_optimizer\.nvme_path='.*/ro': cannot create swap files under it "
        r"\(Read-only file system\)",
    ):
        _build(_cfg(path))


def test_disk_full_at_construction_and_at_the_step_where_it_fills(tmpfs: Any) -> None:
    def cfg(path: Path) -> dict[str, Any]:
        out = _cfg(path, sub_group_size=32768)
        out["offload_param"]["buffer_size"] = 32768
        return out

    tiny = tmpfs("tiny", "size=48k")  # room for the probe, not for the 128 KiB shard of fc1.weight
    with pytest.raises(
        ds_zero.NVMeSwapError,
        match=r"write of the shard of parameter .*param_\d+\.swp.* failed.*"
        r"disk full",
    ):
        _build(cfg(tiny), width=128)
    # shards (128 + 128 + 4 + 4 KiB) and fp32 masters (as much) fit; the fp32 gradients (as much again),
    # written during the first backward, fill the disk
    small = tmpfs("small", "size=640k")
    model, opt = _build(cfg(small), width=128)
    with pytest.raises(
        ds_zero.NVMeSwapError,
        match=r"write of the fp32 gradient of sub-group \d .*tile\d\.grad\.swp.* failed.*disk full",
    ):
        _train(model, opt, 1, width=128)
    # with room for the gradients too, Adam's state fills the disk at step 1
    larger = tmpfs("larger", "size=900k")
    model, opt = _build(cfg(larger), width=128)
    with pytest.raises(ds_zero.NVMeSwapError, match=r"write of the optimizer state 'exp_avg.*sub-group.*failed"):
        _train(model, opt, 1, width=128)


def _efbig(rank: int, world: int, root: str) -> str:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of being killed
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (16384, hard))
    try:
        _build(_cfg(Path(root)))
    except ds_zero.NVMeSwapError as err:
        return str(err)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    return "no error"


def test_file_size_limit_is_a_clear_error(tmp_path: Path) -> None:
    message = run_ranks(1, _efbig, root=str(tmp_path), timeout_s=60)[0]
    assert "write of the shard of parameter" in message and "param_" in message and "failed" in message


def test_truncated_or_overwritten_swap_files_are_errors_at_the_next_swap_in(tmp_path: Path) -> None:
    model, opt = _build(_cfg(tmp_path))
    _train(model, opt, 1)
    # the files get the values held in the pool (written back), and the next gather reads them
    opt.parameter_offload.param_swapper.drop_kept()
    victim = next(p for p in _files(tmp_path, "params") if p.stat().st_size == 8192 * 4)  # fc1/fc2 weight
    os.truncate(victim, 1000)
    with pytest.raises(
        ds_zero.NVMeSwapError,
        match=rf"shard of parameter 'fc\d.weight' is truncated \({victim}: 1000 "
        r"bytes, 32768 were written\)",
    ):
        _train(model, opt, 1, start=1)

    again = tmp_path / "again"
    again.mkdir()
    model, opt = _build(_cfg(again))
    _train(model, opt, 1)
    master = again / "zero_stage_3" / "rank0" / "optimizer" / "tile0.fp32.swp"
    data = bytearray(master.read_bytes())
    data[100:104] = b"\x01\x02\x03\x04"
    master.write_bytes(bytes(data))
    with pytest.raises(ds_zero.NVMeSwapError, match=rf"fp32 master of sub-group 0 .* is corrupted \({master}"):
        _train(model, opt, 1, start=1)


def test_buffers_too_small_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError,
        match=r"offload_param.buffer_size=1000 elements is smaller than the shard of "
        r"parameter .* \(8192 elements",
    ):
        _build(
            _cfg(
                tmp_path,
                offload_param={"device": "nvme", "nvme_path": str(tmp_path), "buffer_size": 1000, "max_in_cpu": 0},
            )
        )
    model, opt = _build(
        _cfg(tmp_path, offload_optimizer={"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 2})
    )
    with pytest.raises(
        ValueError,
        match=r"offload_optimizer.buffer_count=2 is too small: .* 2 state tensors .* "
        r"buffer_count >= 3",
    ):
        _train(model, opt, 1)


def test_max_in_cpu_keeps_the_first_shards_resident_and_init_swaps_at_construction(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, opt=False, offload_optimizer={"device": "cpu"})
    cfg["offload_param"]["max_in_cpu"] = 8192 + 128  # fc1.weight and fc1.bias stay in host memory
    model, opt = _build(cfg)
    swapped = {n for n, p in model.named_parameters() if state_of(p).swap is not None}
    assert swapped == {"fc2.weight", "head.weight"}
    ref_model, ref_opt = _build(_cfg(None, param=False, opt=False))
    assert _train(model, opt, 3) == pytest.approx(_train(ref_model, ref_opt, 3), rel=1e-6, abs=0)
    # ds_zero.Init(remote_device="nvme"): shards go to NVMe as each module is built
    init_cfg = {"zero_optimization": _cfg(tmp_path, opt=False), "aio": {"queue_depth": 4}}
    torch.manual_seed(0)
    with ds_zero.Init(config_dict_or_path=init_cfg, remote_device="nvme"):
        built = Net()
    assert all(state_of(p).swap is not None for p in built.parameters())
    init_swapper = state_of(built.fc1.weight).swap
    base = torch.optim.AdamW(built.parameters(), lr=1e-2, weight_decay=0.01)
    built_opt = ds_zero.DeepSpeedZeroOptimizer_Stage3(built, base, config=_cfg(tmp_path), clip_grad=1.0)
    assert built._ds_zero3.param_swapper is init_swapper  # the optimizer took over Init's swapper, no second pool
    ref_model, ref_opt = _build(_cfg(None, param=False, opt=False))
    assert _train(built, built_opt, 3) == pytest.approx(_train(ref_model, ref_opt, 3), rel=1e-6, abs=0)


def test_stage_1_2_nvme_says_stage_3() -> None:
    model = Net()
    with pytest.raises(ValueError, match=r"not supported at stages 1 and 2 .*zero_optimization.stage=3"):
        ds_zero.DeepSpeedZeroOptimizer(
            torch.optim.AdamW(model.parameters()),
            config=ds_zero.ZeroConfig(stage=2, offload_optimizer={"device": "nvme", "nvme_path": "/tmp"}),
        )


def test_checksum_depends_on_the_bytes_not_on_where_they_lie() -> None:
    from ds_zero._nvme.files import checksum

    values = torch.randn(1003)
    for view in (values[1:], values[3:1002], values.to(torch.bfloat16)[1:]):
        moved = torch.empty(view.numel() + 5, dtype=view.dtype)[5:]
        moved.copy_(view)
        assert checksum(view) == checksum(moved) == checksum(view.clone())
    changed = values.clone()
    changed[500] += 1.0
    assert checksum(changed) != checksum(values)
    assert checksum(values[:1000]) != checksum(values[:999])


def test_inference_with_parameters_on_nvme_and_a_bad_aio_section(tmp_path: Path) -> None:
    torch.manual_seed(0)
    plain = Net()
    x = torch.randn(3, 64)
    expected = plain(x)
    torch.manual_seed(0)
    model = Net()
    offload = ds_zero.DeepSpeedZeRoOffload(model, config=_cfg(tmp_path, opt=False), aio_config={"block_size": 65536})
    with torch.no_grad():
        for _ in range(3):  # the pool holds every shard: the second and third pass read nothing
            torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
    swapper = offload.param_swapper
    assert (swapper.num_reads, swapper.num_writes, swapper.num_kept_hits) == (4, 4, 8)
    with pytest.raises(ValueError, match=r"aio\.queue_depth"):
        ds_zero.DeepSpeedZeRoOffload(Net(), config=_cfg(tmp_path, opt=False), aio_config={"queue_depth": 0})


def test_bf16_shards_on_nvme_train_like_cpu_optimizer_offload(tmp_path: Path) -> None:
    def run(cfg: dict[str, Any]) -> list[float]:
        torch.manual_seed(0)
        model = Net().to(torch.bfloat16)
        opt = ds_zero.DeepSpeedZeroOptimizer_Stage3(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config=cfg)
        losses = []
        for step in range(4):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(6, 64, generator=g).bfloat16(), torch.randn(6, 8, generator=g)
            loss = nn.functional.mse_loss(model(x).float(), y)
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    # same fp32 masters and Adam state, bf16 shards written from them: identical numbers
    assert run(_cfg(tmp_path)) == run(_cfg(None, param=False, opt=False, offload_optimizer={"device": "cpu"}))


def _train_accumulating(model: nn.Module, opt: Any, steps: int, micro: int = 3) -> tuple[list[float], list[float]]:
    losses, norms = [], []
    for step in range(steps):
        for m in range(micro):
            g = torch.Generator().manual_seed(100 * step + m)
            x, y = torch.randn(6, 64, generator=g), torch.randn(6, 8, generator=g)
            loss = nn.functional.mse_loss(model(x), y) / micro
            opt.backward(loss)
            losses.append(loss.item())
        opt.step()
        norms.append(opt.global_grad_norm)
        opt.zero_grad()
    return losses, norms


def test_gradients_swap_to_nvme_and_accumulate_over_micro_steps(tmp_path: Path) -> None:
    ref_model, ref_opt = _build(_cfg(None, param=False, opt=False))
    model, opt = _build(_cfg(tmp_path))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 64, generator=g), torch.randn(6, 8, generator=g)
    opt.backward(nn.functional.mse_loss(model(x), y))
    # after a backward the fp32 gradient partition is on disk, one file per sub-group, not in memory
    assert all(part.master.grad is None for part in opt.partitions)
    grads = sorted((tmp_path / "zero_stage_3" / "rank0" / "optimizer").glob("tile*.grad.swp"))
    assert len(grads) == len(opt.tiles) and sum(f.stat().st_size for f in grads) == 4 * sum(t.numel for t in opt.tiles)
    opt.zero_grad()
    ref_losses, ref_norms = _train_accumulating(ref_model, ref_opt, 3)
    losses, norms = _train_accumulating(model, opt, 3)
    assert losses == pytest.approx(ref_losses, rel=1e-6, abs=0)
    assert norms == pytest.approx(ref_norms, rel=1e-6)


class _Tower(nn.Module):
    """Six Linear(64, 64): 4096-element weight shards, two to a pool buffer of 8192 elements."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x[:, :8]


def _tower(cfg: dict[str, Any]) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = _Tower()
    base = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    return model, ds_zero.DeepSpeedZeroOptimizer_Stage3(model, base, config=cfg, clip_grad=1.0)


def test_released_shards_stay_in_the_pool_until_their_room_is_needed(tmp_path: Path) -> None:
    """A pool that holds every shard reads each once and writes none back until its slices are given up; one
    too small for that gives up the least recently used kept slices, reads them again (ahead of the gathers)
    and writes through; both train exactly like each other, and the kept slices carry the optimizer's writes
    (a stale slice would give other losses from step 2 on)."""
    roomy_dir, tight_dir = tmp_path / "roomy", tmp_path / "tight"
    roomy_dir.mkdir()
    tight_dir.mkdir()
    roomy_model, roomy = _tower(_cfg(roomy_dir))  # 4 buffers: 8 weights
    tight_param = {"device": "nvme", "nvme_path": str(tight_dir), "buffer_count": 2, "buffer_size": 8192}
    tight_param["max_in_cpu"] = 0
    tight_model, tight = _tower(_cfg(tight_dir, offload_param=tight_param))  # 4 of the 6 weights
    plain_model, plain = _tower(_cfg(tmp_path, param=False))  # the optimizer state on NVMe in all three
    expected = _train(plain_model, plain, 4)
    assert _train(roomy_model, roomy, 4) == expected
    assert _train(tight_model, tight, 4) == expected
    roomy_swap, tight_swap = roomy.parameter_offload.param_swapper, tight.parameter_offload.param_swapper
    assert roomy_swap.num_reads == 6 and roomy_swap.num_kept_hits >= 6 * 3  # each weight read once, at step 1
    assert tight_swap.num_reads > 6 and tight_swap.num_read_ahead_hits > 0 and tight_swap.num_kept_hits > 0
    # write-back while the pool never gave up a kept slice: only adoption wrote the files; then writing through
    assert roomy_swap.write_back and roomy_swap.num_writes == 6
    assert not tight_swap.write_back and tight_swap.num_writes > 6 * 4
    for p in roomy_model.parameters():  # a copy outside a gather comes from the kept slice, equal to the file
        if roomy_swap.swapped(p):
            kept = roomy_swap.read_copy(p)
            roomy_swap.drop_kept()
            torch.testing.assert_close(roomy_swap.read_copy(p), kept, rtol=0, atol=0)  # the file got the values
    assert roomy_swap.num_writes == 6 + 6  # drop_kept wrote the dirty slices
    assert _train(roomy_model, roomy, 1, start=4) == _train(plain_model, plain, 1, start=4)
    assert roomy_swap.num_reads == 6 + 6  # after drop_kept each weight is read once more (copies are not counted)


class _RecordedHandle:
    """An aio handle that remembers which memory its writes still read (until its `wait`) and checks that no
    read, on any handle, lands on such memory."""

    def __init__(self, real: Any, log: dict[str, Any]) -> None:
        self._real, self._log = real, log
        log["handles"].append(self)
        self.writing: list[tuple[int, int]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    @staticmethod
    def _span(t: torch.Tensor) -> tuple[int, int]:
        return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()

    def async_pwrite(self, src: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self.writing.append(self._span(src))
        return self._real.async_pwrite(src, *args, **kwargs)

    def async_pread(self, dst: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        lo, hi = self._span(dst)
        in_flight = [s for h in self._log["handles"] for s in h.writing]
        if any(a < hi and lo < b for a, b in in_flight):
            self._log["clobbered"] += 1
        elif in_flight:
            self._log["reads_beside_writes"] += 1
        return self._real.async_pread(dst, *args, **kwargs)

    def wait(self) -> int:
        done = self._real.wait()
        self.writing.clear()
        return done


def test_pipelined_reads_never_land_on_a_buffer_whose_write_is_in_flight(tmp_path: Path, monkeypatch: Any) -> None:
    """Both pipelines share two buffer sets (`optimizer_swapper`'s note): a sub-group's read-ahead goes into the
    buffers the previous sub-group's writes are leaving, each after its own buffer's write, at `step()` and in
    the updates during backward alike; meanwhile the other buffers' writes stay in flight."""
    import ds_zero._stage3.optimizer_swapper as swapper_module

    log: dict[str, Any] = {"handles": [], "clobbered": 0, "reads_beside_writes": 0}
    make = swapper_module.make_aio_handle
    monkeypatch.setattr(swapper_module, "make_aio_handle", lambda cfg: _RecordedHandle(make(cfg), log))
    torch.manual_seed(0)
    model = Net(64)
    base = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt = ds_zero.DeepSpeedZeroOptimizer_Stage3(model, base, config=_cfg(tmp_path, param=False, sub_group_size=600))
    torch.manual_seed(0)
    ref_model = Net(64)  # the same initial weights, no offload
    ref = ds_zero.DeepSpeedZeroOptimizer_Stage3(
        ref_model, torch.optim.AdamW(ref_model.parameters(), lr=1e-2), config=_cfg(None, param=False, opt=False)
    )
    swapper = opt.optimizer_swapper
    assert swapper.num_sets == 2 and len(opt.tiles) >= 4
    in_backward = []
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(6, 64, generator=g), torch.randn(6, 8, generator=g)
        losses = []
        for o, m in ((opt, model), (ref, ref_model)):
            o.set_step_boundary(True)
            loss = nn.functional.mse_loss(m(x), y)
            o.backward(loss)
            if o is opt:
                in_backward.append(0 if swapper.grads.eager is None else len(swapper.grads.eager.stepped))
            o.step()
            o.zero_grad()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-6, abs=0)
    assert in_backward[0] == 0 and all(n == len(opt.tiles) for n in in_backward[1:])  # step() first, then backward
    assert log["clobbered"] == 0
    assert log["reads_beside_writes"] > 0  # the pipelines overlap: reads were issued with other writes in flight
