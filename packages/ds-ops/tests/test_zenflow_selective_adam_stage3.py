"""ZenFlowSelectiveAdamW_stage3 on ZeRO-3 style partitions, against torch.optim.AdamW on the selected columns.

A weight `W` (rows x cols) is laid out as ZenFlow's stage 3 does: its partition holds `W.T` flattened,
here between other elements (`complete_column_offset` > 0 and a tail), so a column of `W` is a row of
the partition. The reference is `torch.optim.AdamW` over `W[:, selected]` with the same gradients;
tolerance 1e-6 absolute / 1e-5 relative in fp32. Everything outside the selected rows must stay
bit-identical. NVMe offload is played by a swapper that keeps partitions in files.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ds_ops import ZenFlowSelectiveAdamW_stage3

ATOL, RTOL = 1e-6, 1e-5
HEAD, TAIL = 5, 3  # elements of the partition before and after the weight's rows


def _partitioned(weight: torch.Tensor, group_id: int = 0) -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.empty(0))  # ZeRO-3: the module's parameter holds no data
    if weight.dim() == 1:
        param.ds_tensor = weight.clone()
        param.ds_shape = tuple(weight.shape)
        param.complete_column_offset, param.complete_numel = 0, weight.numel()
    else:
        body = weight.T.contiguous().flatten()
        param.ds_tensor = torch.cat([torch.full((HEAD,), -7.0), body, torch.full((TAIL,), 7.0)])
        param.ds_shape = (weight.shape[1], weight.shape[0])
        param.complete_column_offset, param.complete_numel = HEAD, body.numel()
    param.group_id = group_id
    return param


def _columns(param: torch.nn.Parameter) -> torch.Tensor:
    """The weight back from the partition (rows x cols)."""
    cols, rows = param.ds_shape
    return param.ds_tensor[HEAD : HEAD + cols * rows].view(cols, rows).T


def _feed(param: torch.nn.Parameter, grad: torch.Tensor, selected: torch.Tensor) -> None:
    param.selected_indices = selected
    param.selected_grad = grad[:, selected].T.clone()


def _reference(
    weight: torch.Tensor, selected: torch.Tensor, grads: list[torch.Tensor], **adamw: object
) -> torch.Tensor:
    cols = torch.nn.Parameter(weight[:, selected].clone())
    ref = torch.optim.AdamW([cols], **adamw)
    for grad in grads:
        cols.grad = grad[:, selected].clone()
        ref.step()
    return cols.detach()


class FileSwapper:
    """Keeps swapped-out partitions in files; the resident tensor is a 0-dim placeholder meanwhile."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.swap_ins = self.swap_outs = self.releases = 0

    def _path(self, param: torch.Tensor) -> Path:
        return self.root / f"{id(param)}.pt"

    def offload(self, param: torch.Tensor) -> None:
        torch.save(param.ds_tensor.data.clone(), self._path(param))
        param.ds_tensor.data = torch.tensor(0.0)

    def stored(self, param: torch.Tensor) -> torch.Tensor:
        return torch.load(self._path(param))

    def swap_in(self, params: list[torch.Tensor], async_op: bool = False) -> None:
        for param in params:
            param.ds_tensor.data = self.stored(param)
        self.swap_ins += 1

    def swap_out_and_release(self, params: list[torch.Tensor]) -> None:
        for param in params:
            torch.save(param.ds_tensor.data.clone(), self._path(param))
            param.ds_tensor.data = torch.tensor(0.0)
        self.swap_outs += 1

    def remove_partition_and_release_buffers(self, params: list[torch.Tensor]) -> None:
        for param in params:
            param.ds_tensor.data = torch.tensor(0.0)
        self.releases += 1


@pytest.mark.parametrize("offload", [False, True], ids=["resident-moments", "offloaded-moments"])
def test_selected_rows_match_adamw_on_the_selected_columns(offload: bool) -> None:
    gen = torch.Generator().manual_seed(21)
    weight = torch.randn(6, 9, generator=gen)
    selected = torch.tensor([0, 4, 8])
    grads = [torch.randn(6, 9, generator=gen) for _ in range(7)]
    param = _partitioned(weight)
    before = param.ds_tensor.clone()

    opt = ZenFlowSelectiveAdamW_stage3([param], lr=1e-2, weight_decay=0.05, offload=offload, bucket_size=1)
    for grad in grads:
        _feed(param, grad, selected)
        opt.step()

    torch.testing.assert_close(
        _columns(param)[:, selected],
        _reference(weight, selected, grads, lr=1e-2, weight_decay=0.05),
        atol=ATOL,
        rtol=RTOL,
    )
    others = torch.ones(9, dtype=torch.bool)
    others[selected] = False
    assert torch.equal(_columns(param)[:, others], weight[:, others]), "unselected columns changed"
    assert torch.equal(param.ds_tensor[:HEAD], before[:HEAD]) and torch.equal(param.ds_tensor[-TAIL:], before[-TAIL:])
    assert opt.state[param]["step"].item() == len(grads)
    if offload:
        assert param.exp_avg_cpu_data.shape == (3, 6)


def test_one_dimensional_partition_is_updated_whole() -> None:
    gen = torch.Generator().manual_seed(4)
    bias = torch.randn(8, generator=gen)
    grads = [torch.randn(8, generator=gen) for _ in range(4)]
    param = _partitioned(bias)
    opt = ZenFlowSelectiveAdamW_stage3([param], lr=1e-2)
    for grad in grads:
        param.selected_indices = torch.arange(8)
        param.selected_grad = grad.clone()
        opt.step()
    ref = torch.nn.Parameter(bias.clone())
    ref_opt = torch.optim.AdamW([ref], lr=1e-2)
    for grad in grads:
        ref.grad = grad.clone()
        ref_opt.step()
    torch.testing.assert_close(param.ds_tensor, ref.detach(), atol=ATOL, rtol=RTOL)


def test_group_step_steps_each_parameter_with_its_group_settings() -> None:
    gen = torch.Generator().manual_seed(9)
    weight = torch.randn(4, 5, generator=gen)
    grad = torch.randn(4, 5, generator=gen)
    selected = torch.tensor([1, 3])
    slow, fast = _partitioned(weight, group_id=0), _partitioned(weight, group_id=1)
    opt = ZenFlowSelectiveAdamW_stage3([{"params": [slow]}, {"params": [fast], "lr": 0.3}], lr=1e-3)
    for p in (fast, slow):
        _feed(p, grad, selected)
    opt.group_step([fast, slow])  # out of group order on purpose
    torch.testing.assert_close(_columns(slow)[:, selected], _reference(weight, selected, [grad], lr=1e-3))
    torch.testing.assert_close(_columns(fast)[:, selected], _reference(weight, selected, [grad], lr=0.3))
    assert slow.selected_grad is None and fast.selected_grad is None


def test_snapshot_is_restored_before_the_update() -> None:
    gen = torch.Generator().manual_seed(6)
    weight = torch.randn(3, 6, generator=gen)
    grad = torch.randn(3, 6, generator=gen)
    selected = torch.tensor([2, 5])
    param = _partitioned(weight)
    opt = ZenFlowSelectiveAdamW_stage3([param], lr=1e-2)
    _feed(param, grad, selected)
    opt.temp_copy_param([param])
    param.ds_tensor[HEAD:-TAIL].add_(50.0)  # the CPU optimizer's full update in between
    opt.step()
    torch.testing.assert_close(_columns(param)[:, selected], _reference(weight, selected, [grad], lr=1e-2))
    assert param.temp_selected_param is None


def test_nvme_partition_is_swapped_in_updated_and_swapped_out(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(13)
    weight = torch.randn(5, 7, generator=gen)
    grads = [torch.randn(5, 7, generator=gen) for _ in range(3)]
    selected = torch.tensor([0, 1, 6])
    param = _partitioned(weight)
    swapper = FileSwapper(tmp_path)
    param.nvme_swapper = swapper
    swapper.offload(param)

    opt = ZenFlowSelectiveAdamW_stage3([param], lr=1e-2)
    for grad in grads:
        _feed(param, grad, selected)
        opt.step()

    assert param.ds_tensor.data.dim() == 0, "the partition was left resident"
    assert (swapper.swap_ins, swapper.swap_outs) == (3, 3)
    param.ds_tensor.data = swapper.stored(param)
    torch.testing.assert_close(
        _columns(param)[:, selected], _reference(weight, selected, grads, lr=1e-2), atol=ATOL, rtol=RTOL
    )


def test_snapshot_of_an_nvme_partition_reads_without_writing_back(tmp_path: Path) -> None:
    param = _partitioned(torch.randn(4, 4))
    swapper = FileSwapper(tmp_path)
    param.nvme_swapper = swapper
    swapper.offload(param)
    stored = swapper.stored(param)
    param.selected_indices = torch.tensor([1, 2])
    param.selected_grad = torch.randn(2, 4)

    ZenFlowSelectiveAdamW_stage3([param], offload=True).temp_copy_param([param])

    assert (swapper.swap_ins, swapper.swap_outs, swapper.releases) == (1, 0, 1)
    assert param.ds_tensor.data.dim() == 0
    cols, rows = param.ds_shape
    assert torch.equal(param.temp_selected_param, stored[HEAD : HEAD + cols * rows].view(cols, rows)[[1, 2]])
    assert param.temp_selected_param.device.type == "cpu"


def test_a_failed_update_leaves_the_nvme_copy_as_it_was(tmp_path: Path) -> None:
    param = _partitioned(torch.randn(4, 4))
    swapper = FileSwapper(tmp_path)
    param.nvme_swapper = swapper
    swapper.offload(param)
    stored = swapper.stored(param)
    param.selected_indices = torch.tensor([0, 3])
    param.selected_grad = torch.randn(3, 4)  # wrong: two rows are selected

    with pytest.raises(ValueError, match=r"selected_grad has shape \(3, 4\)"):
        ZenFlowSelectiveAdamW_stage3([param]).step()

    assert (swapper.swap_outs, swapper.releases) == (0, 1)
    assert param.ds_tensor.data.dim() == 0
    assert torch.equal(swapper.stored(param), stored)


def test_a_non_resident_partition_without_a_swapper_is_a_clear_error() -> None:
    param = _partitioned(torch.randn(3, 3))
    param.ds_tensor.data = torch.tensor(0.0)
    param.selected_indices = torch.tensor([0])
    param.selected_grad = torch.randn(1, 3)
    with pytest.raises(RuntimeError, match="not resident .* no nvme_swapper"):
        ZenFlowSelectiveAdamW_stage3([param]).step()


def test_partial_rows_are_refused() -> None:
    param = _partitioned(torch.randn(3, 4))
    param.complete_numel = 10  # rows are 3 elements long
    param.selected_indices = torch.tensor([0])
    param.selected_grad = torch.randn(1, 3)
    with pytest.raises(ValueError, match="complete_numel=10 is not a whole number of rows of 3 elements"):
        ZenFlowSelectiveAdamW_stage3([param]).step()
