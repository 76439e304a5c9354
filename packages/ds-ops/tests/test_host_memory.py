"""`ds_ops.host_memory.huge_page_zeros`: zeros, 2 MiB-aligned and marked for transparent huge pages
from one huge page up (torch.zeros below), alive as long as any view; and the CPU optimizers keep
large state in it, also after load_state_dict."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from ds_ops import DeepSpeedCPUAdam
from ds_ops.host_memory import HUGE_PAGE, huge_page_zeros

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_eligible(address: int) -> bool | None:
    """The THPeligible flag of the mapping holding `address` in /proc/self/smaps (None: not reported)."""
    smaps = Path("/proc/self/smaps")
    if not smaps.exists():
        return None
    inside = False
    for line in smaps.read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and ":" not in head:  # a mapping's header line: "start-end perms ..."
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "THPeligible:":
            return line.split()[1] == "1"
    return None


def require_thp_reporting(address: int) -> None:
    mode = THP_MODE.read_text().strip() if THP_MODE.exists() else "[never]"
    if "[never]" in mode or thp_eligible(address) is None:
        pytest.skip(f"transparent huge pages are off or not reported here ({mode})")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
@pytest.mark.parametrize("nbytes", [0, 64, HUGE_PAGE - 64, HUGE_PAGE, 3 * HUGE_PAGE + 64])
def test_zeros_of_every_size(nbytes: int, dtype: torch.dtype) -> None:
    numel = nbytes // torch.empty(0, dtype=dtype).element_size()
    tensor = huge_page_zeros(numel, dtype)
    assert tensor.shape == (numel,) and tensor.dtype == dtype and tensor.is_contiguous()
    assert not tensor.any()
    if nbytes >= HUGE_PAGE:
        assert tensor.data_ptr() % HUGE_PAGE == 0


def test_marked_for_huge_pages_and_outlives_its_mapping_object() -> None:
    numel = (8 << 20) // 2
    tensor = huge_page_zeros(numel, torch.bfloat16)
    gc.collect()  # only the tensor refers to the mapping now
    values = torch.arange(numel, dtype=torch.float32).to(torch.bfloat16)
    tensor.copy_(values)
    assert torch.equal(tensor, values)
    require_thp_reporting(tensor.data_ptr())
    assert thp_eligible(tensor.data_ptr()), "the buffer's mapping is not eligible for transparent huge pages"


def test_cpu_adam_state_in_huge_pages_also_after_load() -> None:
    params = [torch.nn.Parameter(torch.randn(HUGE_PAGE // 4 + 5)), torch.nn.Parameter(torch.randn(7))]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = DeepSpeedCPUAdam(params)
    optimizer.step()
    big, small = (optimizer.state[p] for p in params)
    assert big["exp_avg"].shape == params[0].shape and small["exp_avg_sq"].shape == params[1].shape
    assert big["exp_avg"].data_ptr() % HUGE_PAGE == 0 and big["exp_avg_sq"].data_ptr() % HUGE_PAGE == 0
    saved = optimizer.state_dict()
    expected = saved["state"][0]["exp_avg_sq"].clone()
    again = DeepSpeedCPUAdam(params)
    again.load_state_dict(saved)
    loaded = again.state[params[0]]["exp_avg_sq"]
    assert torch.equal(loaded, expected) and loaded.data_ptr() != saved["state"][0]["exp_avg_sq"].data_ptr()
    assert loaded.data_ptr() % HUGE_PAGE == 0
    require_thp_reporting(loaded.data_ptr())
    assert thp_eligible(loaded.data_ptr())
