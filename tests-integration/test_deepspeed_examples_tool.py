"""tools/deepspeed_examples.py's logic that needs neither DeepSpeed nor a DeepSpeedExamples checkout.

What the tool reports is only as good as the reading of each run: the losses it finds, the error line it
names, whether two sides agree, how runs merge into one JSON and one table. And a recipe must refuse to run
a program whose upstream text changed under it, rather than run it unedited.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "tools") not in sys.path:
    sys.path.insert(0, str(ROOT / "tools"))

import _examples_report as report  # noqa: E402 - tools/ is a script folder, not a package
import _examples_training as training  # noqa: E402
import deepspeed_examples as tool  # noqa: E402
from _examples_edit import RecipeError, between, edit_json, substitute  # noqa: E402
from _examples_program import LAUNCHER, PYTHON, Program  # noqa: E402

CIFAR_OUTPUT = """\
[2026-12-04 18:26:30,669] [INFO] [engine.py:1] DeepSpeed info: version=0.19.8
[ 1,     4] loss:  2.328
[ 1,     8] loss:  2.301
some other line with loss: 9.9 but not the program's
[ 1,    12] loss:  nan
Finished Training
"""


def test_losses_are_read_in_order_with_the_programs_pattern() -> None:
    cifar = next(p for p in training.programs() if p.name == "cifar10-zero2")
    losses = report.parse_losses(CIFAR_OUTPUT, cifar.loss_pattern)
    assert losses[:2] == [2.328, 2.301]
    assert len(losses) == 3 and math.isnan(losses[2])


def test_a_line_anchored_pattern_matches_at_line_starts_only() -> None:
    output = "loss 1.5\nrank 1: loss 7.0\nloss 1.25\n"
    assert report.parse_losses(output, r"^loss ([\d.]+)") == [1.5, 1.25]


def test_the_first_error_is_the_exception_closing_the_first_traceback() -> None:
    output = """\
[rank1]: Traceback (most recent call last):
[rank1]:   File "train.py", line 3, in <module>
[rank1]:     engine.step()
[rank1]: ValueError: zero_optimization.stage: 4 is not one of 0, 1, 2, 3
[rank0]: Traceback (most recent call last):
[rank0]: RuntimeError: Connection closed by peer
subprocess exited with error code 1
"""
    assert report.first_error(output) == "ValueError: zero_optimization.stage: 4 is not one of 0, 1, 2, 3"


def test_a_chained_traceback_still_names_its_first_exception() -> None:
    output = (
        "Traceback (most recent call last):\n  File 'x.py', line 1\n"
        "torch.distributed.DistBackendError: NCCL error\n\nDuring handling...\nKeyError: 'x'\n"
    )
    assert report.first_error(output) == "torch.distributed.DistBackendError: NCCL error"


def test_without_a_traceback_the_last_error_line_or_the_last_line_is_named() -> None:
    assert report.first_error("start\nerror: launcher lost rank 1\nbye\n") == "error: launcher lost rank 1"
    assert report.first_error("start\nKilled by the timeout\n") == "Killed by the timeout"
    assert report.first_error("one\ntwo\n\n") == "two"
    assert report.first_error("") == ""


def test_losses_agree_within_tolerance_and_not_beyond() -> None:
    same = report.agreement([2.3, 2.2], [2.3, 2.2], deterministic=True)
    assert same == {"agree": True, "max_diff": 0.0, "why": ""}
    close = report.agreement([2.3, 2.2], [2.3, 2.2 * (1 + report.RTOL / 2)], deterministic=True)
    assert close["agree"] is True and close["max_diff"] > 0
    far = report.agreement([2.3, 2.2], [2.3, 2.25], deterministic=True)
    assert far["agree"] is False and "loss #2" in far["why"] and far["max_diff"] == pytest.approx(0.05)


def test_loss_lists_of_different_length_or_with_one_nan_disagree() -> None:
    shorter = report.agreement([2.3, 2.2, 2.1], [2.3, 2.2], deterministic=True)
    assert shorter["agree"] is False and "3 vs 2" in shorter["why"]
    nan = report.agreement([2.3, float("nan")], [2.3, 2.2], deterministic=True)
    assert nan["agree"] is False and nan["max_diff"] == math.inf
    both_nan = report.agreement([float("nan")], [float("nan")], deterministic=True)
    assert both_nan["agree"] is True


def test_an_unseeded_program_reports_the_difference_but_no_verdict() -> None:
    result = report.agreement([1.0, 2.0], [1.5, 2.0], deterministic=False)
    assert result["agree"] is None and result["max_diff"] == 0.5
    assert report.agreement([], [1.0], deterministic=True)["agree"] is None


def _side(status: str, losses: list[float], wall: float = 10.0, error: str = "") -> dict[str, object]:
    return {"status": status, "rc": 0 if status == "ran" else 1, "first_error": error, "losses": losses, "wall_s": wall}


def test_a_side_run_merges_into_the_other_sides_results() -> None:
    reference = {
        "examples_commit": "abc",
        "programs": {
            "p1": {"source": "training/x", "sides": {"deepspeed": _side("ran", [1.0])}},
            "p2": {"source": "training/y", "sides": {"deepspeed": _side("ran", [3.0])}},
        },
    }
    ours = {
        "examples_commit": "abd",
        "programs": {"p1": {"source": "training/x", "sides": {"ds": _side("ran", [1.0])}}},
    }
    merged = report.merge(reference, ours)
    assert merged["examples_commit"] == "abd"
    assert set(merged["programs"]["p1"]["sides"]) == {"deepspeed", "ds"}
    assert merged["programs"]["p2"] == reference["programs"]["p2"]
    again = report.merge(merged, {"programs": {"p1": {"sides": {"ds": _side("failed", [], error="boom")}}}})
    assert again["programs"]["p1"]["sides"]["ds"]["status"] == "failed"
    assert again["programs"]["p1"]["sides"]["deepspeed"]["losses"] == [1.0]
    assert reference["programs"]["p1"]["sides"].keys() == {"deepspeed"}  # the inputs are not modified


def test_the_table_has_a_row_per_program_with_outcomes_losses_agreement_and_time() -> None:
    results = {
        "programs": {
            "good": {
                "source": "training/a",
                "deterministic": True,
                "sides": {"deepspeed": _side("ran", [2.0, 1.5], 30), "ds": _side("ran", [2.0, 1.5], 12)},
            },
            "bad": {
                "source": "training/b",
                "deterministic": True,
                "notes": "tiny model",
                "sides": {
                    "deepspeed": _side("ran", [2.0, 1.5]),
                    "ds": _side("failed", [2.0], error="ValueError: a | b"),
                },
            },
            "half": {"source": "training/c", "sides": {"ds": _side("ran", [1.0])}},
        }
    }
    lines = report.markdown_table(results).splitlines()
    assert len(lines) == 2 + 3
    good, bad, half = lines[2:]
    assert good.startswith("| good | training/a | ran | ran | 2.0000 → 1.5000 (2) |")
    assert "yes (max diff 0)" in good and good.endswith("| 30 / 12 |")
    assert "**failed**: `ValueError: a \\| b`" in bad and "**no** (2 vs 1 losses" in bad
    assert "| not run | ran |" in half
    assert report.notes_list(results) == "- **bad**: tiny model"


def test_a_substitution_fails_loudly_when_its_anchor_is_missing_or_ambiguous(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("a = 1\nb = 2\nb = 2\n")
    with pytest.raises(RecipeError, match=r"train.py: expected 'c = 3' 1 time\(s\), found it 0"):
        substitute(script, "c = 3", "c = 4")
    with pytest.raises(RecipeError, match="found it 2"):
        substitute(script, "b = 2", "b = 3")
    substitute(script, "b = 2", "b = 3", count=2)
    substitute(script, "a = 1", "a = 0")
    assert script.read_text() == "a = 0\nb = 3\nb = 3\n"
    with pytest.raises(RecipeError, match="end anchor"):
        between("x <<EOF body", "<<EOF", "EOF\n", "run.sh")


def test_a_config_edit_refuses_a_key_the_config_does_not_have(tmp_path: Path) -> None:
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"train_batch_size": 256, "steps_per_print": 10}))
    with pytest.raises(RecipeError, match="train_batch"):
        edit_json(config, {"train_batch": 16})
    edit_json(config, {"train_batch_size": 16})
    assert json.loads(config.read_text()) == {"train_batch_size": 16, "steps_per_print": 10}


def test_a_config_addition_refuses_a_key_the_config_already_has(tmp_path: Path) -> None:
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"train_batch_size": 256}))
    with pytest.raises(RecipeError, match="already set"):
        edit_json(config, {"train_batch_size": 16}, new_keys=True)
    edit_json(config, {"gradient_clipping": 0.0}, new_keys=True)
    assert json.loads(config.read_text()) == {"train_batch_size": 256, "gradient_clipping": 0.0}


def test_a_recipe_stops_on_a_changed_upstream_file_and_edits_an_unchanged_one(tmp_path: Path) -> None:
    changed = tmp_path / "changed"
    changed.mkdir()
    (changed / "cifar10_deepspeed.py").write_text("def main(args):\n    model = Net(args)\n")
    with pytest.raises(RecipeError, match="cifar10_deepspeed.py"):
        training._prepare_cifar(changed, changed)
    same = tmp_path / "same"
    same.mkdir()
    (same / "cifar10_deepspeed.py").write_text("def main(args):\n    net = Net(args)\n")
    assert training._prepare_cifar(same, same) == same
    assert "torch.manual_seed(0)" in (same / "cifar10_deepspeed.py").read_text()
    assert (same / "torchvision" / "datasets.py").is_file()


def test_every_recipe_names_a_unique_program_with_a_one_group_loss_pattern() -> None:
    programs = training.programs()
    assert len({p.name for p in programs}) == len(programs)
    for program in programs:
        assert program.loss_pattern.count("(") - program.loss_pattern.count("\\(") >= 1, program.name
        assert any(LAUNCHER in arg for arg in program.argv), program.name


def test_placeholders_become_the_sides_interpreter_and_launcher_with_a_port() -> None:
    argv = (LAUNCHER, "--num_gpus", "2", "x.py")
    assert tool.expand(argv, Path("/v/bin/python"), Path("/v/bin/deepspeed"), 29555) == [
        "/v/bin/deepspeed",
        "--master_port",
        "29555",
        "--num_gpus",
        "2",
        "x.py",
    ]
    line = ("bash", "-c", f"{PYTHON} make.py && {LAUNCHER} a.py && {LAUNCHER} b.py")
    assert (
        tool.expand(line, Path("/p"), Path("/d"), 1)[2]
        == "/p make.py && /d --master_port 1 a.py && /d --master_port 1 b.py"
    )


def test_chat_programs_join_when_their_module_is_there(monkeypatch: pytest.MonkeyPatch) -> None:
    chat = Program(
        name="chat-step1", source="applications/DeepSpeed-Chat", prepare=lambda s, w: w, argv=(), loss_pattern="(x)"
    )
    monkeypatch.setitem(sys.modules, "_examples_chat", types.SimpleNamespace(programs=lambda: [chat]))
    programs, notes = tool.all_programs()
    assert programs[-1] is chat and notes == []
    monkeypatch.setitem(sys.modules, "_examples_chat", None)  # import of it raises ModuleNotFoundError
    programs, notes = tool.all_programs()
    assert chat not in programs and "absent" in notes[0]


def test_the_synthetic_cifar_is_fixed_and_shaped_like_cifar(tmp_path: Path) -> None:
    from _examples_edit import SHIMS

    sys.path.insert(0, str(SHIMS))
    try:
        from torchvision import datasets, transforms
    finally:
        sys.path.remove(str(SHIMS))
    first = datasets.CIFAR10(root=str(tmp_path), train=True, transform=transforms.ToTensor())
    second = datasets.CIFAR10(root=str(tmp_path), train=True, transform=transforms.ToTensor())
    image, label = first[3]
    assert image.shape == (3, 32, 32) and 0 <= image.min() and image.max() <= 1 and 0 <= label < 10
    assert torch.equal(image, second[3][0]) and first.targets == second.targets
    assert len(datasets.CIFAR10(root="", train=False)) == datasets.TEST_SIZE
    # The pipeline example's order: Resize and CenterCrop on the image (uint8 HWC, as on a PIL image), then ToTensor.
    pil_first = transforms.Compose(
        [
            transforms.Resize(72),
            transforms.CenterCrop(64),
            transforms.ToTensor(),
            transforms.Normalize((0.5,) * 3, (0.5,) * 3),
        ]
    )
    tensor_first = transforms.Compose([transforms.ToTensor(), transforms.Resize(72), transforms.CenterCrop(64)])
    raw = first.data[3]
    assert pil_first(raw).shape == (3, 64, 64) and tensor_first(raw).shape == (3, 64, 64)
    assert transforms.Resize((40, 50))(raw).shape == (40, 50, 3)


def test_an_export_skips_blobs_a_partial_checkout_lacks(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "training" / "x").mkdir(parents=True)
    (repo / "training" / "x" / "train.py").write_text("print('hi')\n")
    (repo / "training" / "x" / "data.bin").write_bytes(b"\0" * 64)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "x"], check=True)
    assert tool.export_folder(repo / ".git", "training/x", tmp_path / "whole") == []
    assert (tmp_path / "whole" / "training" / "x" / "train.py").read_text() == "print('hi')\n"
    blob = subprocess.run([*git, "rev-parse", "HEAD:training/x/data.bin"], capture_output=True, text=True, check=True)
    sha = blob.stdout.strip()
    (repo / ".git" / "objects" / sha[:2] / sha[2:]).unlink()
    missing = tool.export_folder(repo / ".git", "training/x", tmp_path / "partial")
    assert missing == ["training/x/data.bin"]
    assert (tmp_path / "partial" / "training" / "x" / "train.py").is_file()


def test_an_error_whose_message_starts_on_the_next_line_keeps_that_line() -> None:
    output = (
        "[rank0]: Traceback (most recent call last):\n[rank0]:   File 'x.py', line 1\n"
        "[rank0]: ds_engine.config._errors.DeepSpeedConfigError: invalid config:\n"
        "[rank0]:   bf16.bf16_master_weights_and_grads: not supported\n[rank1]: Traceback (most recent call last):\n"
    )
    assert report.first_error(output) == (
        "ds_engine.config._errors.DeepSpeedConfigError: invalid config: "
        "bf16.bf16_master_weights_and_grads: not supported"
    )
