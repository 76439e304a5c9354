"""The `Checkpointer` saves and loads anything that has the `CheckpointedEngine` face, not only an engine.

The checkpoint layer sits below the engine: it learns the engine's parts once (`CheckpointParts`) and reads
the live training state through a small protocol. These tests drive it with a plain object built from a
module, a torch optimizer and a scheduler, so a checkpoint round trip is checked without any engine, and
check that no checkpoint module refers to the engine layers above it.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ds_engine._checkpoint.checkpointer import CheckpointedEngine, Checkpointer, CheckpointParts
from ds_engine._plan.dist_info import DistInfo
from ds_engine._step.steppers import PlainOptimizerState
from ds_engine.config import DeepSpeedConfig

CHECKPOINT_LAYER = Path(__file__).resolve().parents[1] / "src" / "ds_engine" / "_checkpoint"


class AdamState(PlainOptimizerState):
    """A stage-0 stepper's saving face over a plain torch optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._norm = None


class Trained:
    """A module with an optimizer, a scheduler and DeepSpeed's counters: the protocol, nothing more."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.module = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        self.optimizer = torch.optim.Adam(self.module.parameters(), lr=1e-2)
        self.lr_scheduler: Any = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=2, gamma=0.5)
        self.global_steps = self.global_samples = self.micro_steps = self.skipped_steps = 0

    def train_batch_size(self) -> int:
        return 4

    def gradient_accumulation_steps(self) -> int:
        return 1

    def module_state_dict(
        self,
        destination: dict[str, Any] | None = None,
        prefix: str = "",
        keep_vars: bool = False,
        exclude_frozen_parameters: bool = False,
    ) -> dict[str, Any]:
        return dict(self.module.state_dict(prefix=prefix, keep_vars=keep_vars))

    def load_module_state_dict(
        self, checkpoint: dict[str, Any], strict: bool = True, custom_load_fn: Any = None
    ) -> None:
        self.module.load_state_dict(checkpoint["module"], strict=strict)

    def train(self, steps: int) -> None:
        for _ in range(steps):
            x = torch.randn(4, 4)
            loss = self.module(x).square().mean()
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
            self.lr_scheduler.step()
            self.global_steps += 1
            self.micro_steps += 1
            self.global_samples += self.train_batch_size()


def _checkpointer(trained: Trained, config: dict[str, Any] | None = None) -> Checkpointer:
    ds_config = DeepSpeedConfig({"train_batch_size": 4, **(config or {})}, world_size=1)
    face: CheckpointedEngine = trained  # the protocol is all the checkpointer sees
    parts = CheckpointParts(
        stepper=AdamState(trained.optimizer),
        zero=ds_config.zero,
        moe=None,
        tensor_parallel=None,
        dist=DistInfo(),
        device=torch.device("cpu"),
        settings=ds_config.parsed.checkpoint,
        ds_config=ds_config.raw,
    )
    return Checkpointer(face, parts)


@pytest.mark.parametrize("layout", ["ds", "deepspeed"])
def test_round_trip_without_an_engine(tmp_path: Path, layout: str) -> None:
    saved = Trained(seed=0)
    saved.train(3)
    _checkpointer(saved, {"checkpoint": {"layout": layout}}).save(tmp_path, client_state={"epoch": 7})
    weights = {k: v.clone() for k, v in saved.module.state_dict().items()}
    optimizer_state = saved.optimizer.state_dict()
    lr = saved.optimizer.param_groups[0]["lr"]

    loaded = Trained(seed=1)  # other weights, no optimizer state, counters at zero
    path, client_state = _checkpointer(loaded, {"checkpoint": {"layout": layout}}).load(tmp_path)

    assert path is not None and Path(path).parent == tmp_path / "global_step3"
    assert client_state is not None and client_state["epoch"] == 7
    for name, value in loaded.module.state_dict().items():
        torch.testing.assert_close(value, weights[name], rtol=0, atol=0)
    for index, state in optimizer_state["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(loaded.optimizer.state_dict()["state"][index][key], value, rtol=0, atol=0)
    assert (loaded.global_steps, loaded.global_samples, loaded.micro_steps) == (3, 12, 3)
    assert loaded.lr_scheduler.last_epoch == 3 and loaded.optimizer.param_groups[0]["lr"] == lr

    # The two continue identically: the load restored everything the next steps depend on (RNG included).
    torch.manual_seed(5)
    saved.train(2)
    torch.manual_seed(5)
    loaded.train(2)
    for name, value in loaded.module.state_dict().items():
        torch.testing.assert_close(value, saved.module.state_dict()[name], rtol=0, atol=0)


def test_load_module_only_keeps_counters_and_optimizer(tmp_path: Path) -> None:
    saved = Trained(seed=0)
    saved.train(2)
    _checkpointer(saved).save(tmp_path)
    loaded = Trained(seed=1)
    _checkpointer(loaded).load(tmp_path, load_module_only=True)
    torch.testing.assert_close(loaded.module[0].weight, saved.module[0].weight, rtol=0, atol=0)
    assert loaded.global_steps == 0 and loaded.optimizer.state_dict()["state"] == {}


def test_save_16bit_model_writes_the_module_state(tmp_path: Path) -> None:
    trained = Trained(seed=0)
    assert _checkpointer(trained).save_16bit_model(tmp_path, "weights.bin")
    state = torch.load(tmp_path / "weights.bin", weights_only=True)
    torch.testing.assert_close(state["2.bias"], trained.module[2].bias.detach(), rtol=0, atol=0)


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_no_checkpoint_module_refers_to_an_engine_layer() -> None:
    """Not even for type checking: the engine hands the checkpointer what it needs, so the layers form no circle."""
    offenders = {
        f"{path.relative_to(CHECKPOINT_LAYER)} imports {name}"
        for path in CHECKPOINT_LAYER.rglob("*.py")
        for name in _imported_modules(path)
        if name.startswith(("ds_engine._engine", "ds_engine._pipeline", "ds_engine._setup", "ds_engine._hybrid"))
    }
    assert not offenders
