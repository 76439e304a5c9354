"""The per-parameter accessors with the optimizer on NVMe, against the same model with the optimizer in memory.

`get_full_hp_param` / `get_fp32_grad_for_param` / optimizer state, their local forms and every setter must
read and write the values the step then uses, exactly as the in-memory optimizer does: after the same
edits, both runs take the same step (same masters, same Adam state, same clipped-gradient norm).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_nvme_offload import _build, _cfg
from torch import nn


def _backward(model: nn.Module, opt: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(6, 64, generator=g), torch.randn(6, 8, generator=g)
    opt.backward(nn.functional.mse_loss(model(x), y))


def _pair(tmp_path: Path) -> tuple[tuple[nn.Module, Any], tuple[nn.Module, Any]]:
    return _build(_cfg(tmp_path, param=False)), _build(_cfg(None, param=False, opt=False))


def test_getters_read_the_swapped_master_state_and_gradient(tmp_path: Path) -> None:
    (model, opt), (ref_model, ref_opt) = _pair(tmp_path)
    for step in range(2):
        for m, o in ((model, opt), (ref_model, ref_opt)):
            _backward(m, o, step)
        pairs = list(zip(model.parameters(), ref_model.parameters(), strict=True))
        for p, r in pairs:
            torch.testing.assert_close(opt.get_fp32_grad_for_param(p), ref_opt.get_fp32_grad_for_param(r))
            torch.testing.assert_close(opt.get_local_fp32_grad_for_param(p), ref_opt.get_local_fp32_grad_for_param(r))
            torch.testing.assert_close(opt.get_full_hp_param(p), ref_opt.get_full_hp_param(r))
            torch.testing.assert_close(opt.get_local_fp32_param(p), ref_opt.get_local_fp32_param(r))
            if step:
                for key in ("exp_avg", "exp_avg_sq"):
                    torch.testing.assert_close(opt.get_full_hp_param(p, key), ref_opt.get_full_hp_param(r, key))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        # between steps the NVMe run still holds only placeholders: the getters read the files
        assert opt.optimizer.state[opt.tiles[0].master]["exp_avg"].stride() == (0,)
    with pytest.raises(ValueError, match="optimizer state 'momentum' not found"):
        opt.get_full_hp_param(model.fc1.weight, "momentum")


def _edit(model: nn.Module, opt: Any) -> None:
    """The same edits through every setter: gradients doubled/replaced, a master and an Adam state changed."""
    fc1, fc2, head = model.fc1.weight, model.fc2.weight, model.head.weight
    opt.set_fp32_grad_for_param(2 * opt.get_fp32_grad_for_param(fc1), fc1)
    opt.set_local_grad_for_param(torch.full_like(opt.get_local_fp32_grad_for_param(head), 0.5), head)
    opt.set_full_hp_param(opt.get_full_hp_param(fc2) + 0.25, fc2)
    opt.set_local_hp_param(opt.get_local_fp32_param(head) * 0.5, head)
    opt.set_full_hp_param(opt.get_full_hp_param(fc1, "exp_avg") + 1e-3, fc1, "exp_avg")
    opt.set_local_hp_param(opt.get_local_fp32_param(fc2, "exp_avg_sq") * 2, fc2, "exp_avg_sq")


def test_setters_change_what_the_next_step_uses(tmp_path: Path) -> None:
    (model, opt), (ref_model, ref_opt) = _pair(tmp_path)
    for m, o in ((model, opt), (ref_model, ref_opt)):
        _backward(m, o, 0)
        o.step()
        o.zero_grad()
        _backward(m, o, 1)
        _edit(m, o)
    # the edits landed: read back before the step
    torch.testing.assert_close(
        opt.get_local_fp32_grad_for_param(model.head.weight), torch.full((8 * 64,), 0.5), rtol=0, atol=0
    )
    for o in (opt, ref_opt):
        o.step()
    # the doubled gradient changed the clipping norm the same way in both runs
    assert opt.global_grad_norm == pytest.approx(ref_opt.global_grad_norm, rel=1e-6)
    for p, r in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(opt.get_full_hp_param(p), ref_opt.get_full_hp_param(r), rtol=1e-5, atol=1e-5)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.get_full_hp_param(p, key), ref_opt.get_full_hp_param(r, key))
    # and the model's own (16-bit path) shards follow the edited masters
    x = torch.randn(3, 64)
    torch.testing.assert_close(model(x), ref_model(x), rtol=1e-5, atol=1e-6)


def test_a_gradient_set_before_any_backward_is_stepped(tmp_path: Path) -> None:
    (model, opt), (ref_model, ref_opt) = _pair(tmp_path)
    for m, o in ((model, opt), (ref_model, ref_opt)):
        assert torch.count_nonzero(o.get_fp32_grad_for_param(m.fc1.weight)) == 0
        o.set_fp32_grad_for_param(torch.ones_like(m.fc1.weight), m.fc1.weight)
        o.step()
    torch.testing.assert_close(opt.get_full_hp_param(model.fc1.weight), ref_opt.get_full_hp_param(ref_model.fc1.weight))
    assert opt.global_grad_norm == pytest.approx(ref_opt.global_grad_norm, rel=1e-6)
