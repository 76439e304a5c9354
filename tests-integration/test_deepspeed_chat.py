"""DeepSpeed-Chat's three steps on ds, on 2 CPU ranks (skipped unless `DS_EXAMPLES_GIT` names a checkout).

`DS_EXAMPLES_GIT` is a DeepSpeedExamples git directory; DeepSpeed-Chat (`applications/DeepSpeed-Chat`) is
exported from its HEAD into a scratch folder and made small and offline by tools/_examples_chat.py's recipe
(synthetic `local/jsonfile` data, a 2-layer OPT built from a config, a locally trained tokenizer). Each case
runs one step's unmodified `main.py` through `python -m ds_launcher --num_gpus 2` and checks what the step
promises: SFT lowers the LM loss, the reward model learns to rank chosen over rejected, PPO runs its
generate/train loop through the hybrid engine and saves actor and critic. tools/deepspeed_examples.py runs
the same recipes beside DeepSpeed 0.19.8 and compares the losses.

Needs transformers, tokenizers and datasets (DeepSpeed-Chat imports them); skipped without them.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, free_port

EXAMPLES_GIT = os.environ.get("DS_EXAMPLES_GIT")
pytestmark = [
    pytest.mark.skipif(not EXAMPLES_GIT, reason="DS_EXAMPLES_GIT (a DeepSpeedExamples git directory) not set"),
    pytest.mark.timeout(900),
]

sys.path.insert(0, str(ROOT / "tools"))
import _examples_chat as chat  # noqa: E402
from _examples_program import LAUNCHER  # noqa: E402

_PROGRAMS = {program.name: program for program in chat.programs()}


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DeepSpeed-Chat's code and training scripts from the checkout's HEAD (its large media files are skipped)."""
    for module in ("transformers", "tokenizers", "datasets"):
        pytest.importorskip(module, reason=f"DeepSpeed-Chat needs {module}")
    root = tmp_path_factory.mktemp("chat-export")
    folders = [f"{chat.SOURCE}/dschat", f"{chat.SOURCE}/training"]
    archive = subprocess.run(
        ["git", "--git-dir", str(EXAMPLES_GIT), "archive", "HEAD", *folders], capture_output=True, check=True
    )
    subprocess.run(["tar", "x", "-C", str(root)], input=archive.stdout, check=True)
    return root / chat.SOURCE


def _run(export: Path, tmp_path: Path, name: str, *extra: str) -> tuple[str, Path]:
    """Prepare a fresh copy for program `name` and run it on ds; its output and run folder."""
    import shutil

    program = _PROGRAMS[name]
    work = tmp_path / "chat"
    shutil.copytree(export, work, symlinks=True)
    run_dir = program.prepare(export, work)
    launcher = [sys.executable, "-m", "ds_launcher", "--master_port", str(free_port())]
    argv = [part for arg in program.argv for part in (launcher if arg == LAUNCHER else [arg])]
    env = {**os.environ, **program.env, "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"}
    env["HF_HOME"] = str(tmp_path / "hf")
    done = subprocess.run(
        [*argv, *extra], cwd=run_dir, env=env, capture_output=True, text=True, timeout=program.timeout_s
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    return output, run_dir


def _losses(output: str, pattern: str) -> list[float]:
    values = [float(v) for v in re.findall(pattern, output)]
    assert values and all(math.isfinite(v) for v in values), values
    return values


def _eval_losses(output: str) -> list[float]:
    return [float(v) for v in re.findall(rf"ppl: \S+, loss: ({chat.FLOAT})", output)]


def test_step1_sft_zero2_bf16_learns_and_saves_a_loadable_model(export: Path, tmp_path: Path) -> None:
    import torch

    output, run_dir = _run(export, tmp_path, "chat-step1-zero2-bf16")
    losses = _losses(output, chat.STEP1_LOSS)
    assert len(losses) == 8  # 32 SFT rows / (2 ranks x 2 per rank), one epoch
    before, after = _eval_losses(output)
    assert after < before - 0.3, (before, after)
    state = torch.load(run_dir / "output" / "pytorch_model.bin", map_location="cpu")
    assert state["model.decoder.embed_tokens.weight"].shape == (304, 64)


def test_step1_lora_zero3_offload_checkpointing_fp16(export: Path, tmp_path: Path) -> None:
    # DeepSpeed-Chat's ZeRO-3 + CPU offload + LoRA (only the LoRA weights train) + gradient checkpointing,
    # in fp16 (its default dtype; the bf16 variant is the chat-step1-lora-zero3-offload-bf16 program).
    output, _ = _run(export, tmp_path, "chat-step1-lora-zero3-offload-fp16")
    assert len(_losses(output, chat.STEP1_LOSS)) == 8
    before, after = _eval_losses(output)
    assert after < before, (before, after)


def test_step2_reward_model_zero2_ranks_chosen_over_rejected(export: Path, tmp_path: Path) -> None:
    output, run_dir = _run(export, tmp_path, "chat-step2-zero2-bf16")
    first, second = _losses(output, chat.STEP2_LOSS)  # mean loss of each of the 2 epochs
    assert second < first < math.log(2) + 0.2, (first, second)
    accuracy = [float(v) for v in re.findall(rf"acc \(higher is better\) : ({chat.FLOAT})", output)]
    assert accuracy[-1] == 1.0, accuracy
    assert (run_dir / "output" / "pytorch_model.bin").is_file()


def test_step3_ppo_with_hybrid_engine_and_lora_zero2(export: Path, tmp_path: Path) -> None:
    output, run_dir = _run(export, tmp_path, "chat-step3-zero2-hybrid-lora-bf16")
    assert len(_losses(output, chat.STEP3_LOSS)) == 4  # --test_stop_step 4: four generate + train rounds
    critic = [float(v) for v in re.findall(rf"Critic Loss: ({chat.FLOAT})", output)]
    assert len(critic) == 4 and all(math.isfinite(v) and v >= 0 for v in critic), critic
    for role in ("actor", "critic"):
        assert (run_dir / "output" / role / "pytorch_model.bin").is_file()
