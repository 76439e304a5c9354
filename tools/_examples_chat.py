"""DeepSpeed-Chat (DeepSpeedExamples/applications/DeepSpeed-Chat) as tools/deepspeed_examples.py runs it.

DeepSpeed-Chat trains a chat model in three steps, each its own `main.py` under `training/`: step 1 supervised
fine-tuning (SFT) of a causal LM, step 2 a reward model (the LM's trunk plus a value head, trained on
chosen/rejected pairs), step 3 RLHF with PPO (actor, reference, critic and reward engines; the actor
generates through DeepSpeed's hybrid engine). Each program here is one step in one of the configurations
DeepSpeed-Chat's scripts use (LoRA, ZeRO-2, ZeRO-3 with CPU offload, gradient checkpointing, bf16), made
small and offline:

* data: DeepSpeed-Chat's own `local/jsonfile` dataset (`data/train.json`, `data/eval.json` beside the `dschat`
  package it is imported from), filled with synthetic prompt/chosen/rejected rows;
* model: a 2-layer OPT (hidden 64) built from a config and saved with `save_pretrained`, with a byte-level BPE
  tokenizer trained on that data and saved in OPT's tokenizer layout (a GPT-2 tokenizer with `</s>` as
  bos/eos, which DeepSpeed-Chat's `num_padding_at_beginning=1` assumes); step 3 also gets a reward-model
  checkpoint (`pytorch_model.bin` with the `rwtransformer.*`/`v_head.*` keys step 2 writes);
* code: `dschat` is linked into the step's folder (the scripts import it; DeepSpeed-Chat's README installs it
  with `pip install -e .`), and one line is edited for transformers 5 (`no_init_weights` moved to
  `transformers.initialization`).

Every side runs the same files: the model, tokenizer and data are built from fixed seeds, dropout is 0 and
generation is greedy, so losses are deterministic up to each side's kernels.
"""

from __future__ import annotations

import json
import math
import os
import random
from functools import partial
from pathlib import Path

from _examples_program import LAUNCHER, Program

SOURCE = "applications/DeepSpeed-Chat"

STEP_DIRS = {
    1: "training/step1_supervised_finetuning",
    2: "training/step2_reward_model_finetuning",
    3: "training/step3_rlhf_finetuning",
}

#: The tiny model every step starts from (built in the step's folder).
MODEL_DIR = "tiny-opt"
#: Step 3's critic/reward checkpoint, in step 2's output layout.
CRITIC_DIR = "tiny-critic"

_HIDDEN = 64
_LAYERS = 2
_HEADS = 4
_FFN = 128
_BPE_VOCAB = 300
_TRAIN_ROWS = 160
_EVAL_ROWS = 40

_COLORS = ("red", "blue", "green", "yellow", "black", "white")
_THINGS = ("apple", "sky", "grass", "sun", "coal", "snow", "car", "house", "ball", "cup")

# Deterministic and not oversubscribed on a small CPU host: two ranks, one thread each.
_ENV = {"OMP_NUM_THREADS": "1"}

# A printed float; strict, because two ranks' lines can interleave mid-line ("loss = 5.46Epoch: ...").
FLOAT = r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?"
# Rank 0's per-step losses (`--print_loss`): ranks print in any order, rank 0's lines keep theirs.
STEP1_LOSS = rf"Epoch: \d+, Step: \d+, Rank: 0, loss = ({FLOAT})"
# Step 2 prints the epoch's mean loss (and, with --eval_interval 1, scores after every step).
STEP2_LOSS = rf"Epoch \d+/\d+ with loss ({FLOAT})"
# Step 3 prints the actor's and critic's mean PPO losses after each generation batch; the pattern takes the actor's.
STEP3_LOSS = rf"Actor Loss: ({FLOAT}) \| Critic Loss"


try:  # the runner reports a recipe that no longer fits as "not prepared" (tools/_examples_edit.py)
    from _examples_edit import RecipeError
except ModuleNotFoundError:  # a tools/ without it: the same meaning, a plain error

    class RecipeError(RuntimeError):  # type: ignore[no-redef]
        """An edit's anchor text is not in the exported file: DeepSpeed-Chat changed, the recipe must follow."""


def substitute(path: Path, old: str, new: str) -> None:
    """Replace the one occurrence of `old` in `path` by `new`.

    Raises:
        RecipeError: `old` occurs zero times or more than once (names the file and the anchor).
    """
    text = path.read_text()
    count = text.count(old)
    if count != 1:
        raise RecipeError(f"{path}: expected the anchor {old!r} once, found it {count} times")
    path.write_text(text.replace(old, new))


def _edit_sources(root: Path, step: int) -> None:
    """The source edits a step needs (none changes what DeepSpeed is asked to do)."""
    # transformers 5 moved `no_init_weights` out of modeling_utils.
    substitute(
        root / "dschat/utils/model/model_utils.py",
        "from transformers.modeling_utils import no_init_weights",
        "from transformers.initialization import no_init_weights",
    )
    if step == 3:
        # Step 3 imports TensorBoard's writer at module level although only --enable_tensorboard uses it, and
        # DeepSpeed's venv has no tensorboard: import it where the writer is made.
        main = root / STEP_DIRS[3] / "main.py"
        substitute(main, "from torch.utils.tensorboard import SummaryWriter\n", "")
        substitute(
            main,
            "        writer = SummaryWriter(\n",
            "        from torch.utils.tensorboard import SummaryWriter\n\n        writer = SummaryWriter(\n",
        )


def _rows(rng: random.Random, count: int) -> list[dict[str, str]]:
    rows = []
    for _ in range(count):
        thing, color = rng.choice(_THINGS), rng.choice(_COLORS)
        rows.append(
            {
                "prompt": f"Human: What color is the {thing}? Assistant:",
                "chosen": f"The {thing} is {color}.",
                "rejected": f"I do not like the {thing}.",
            }
        )
    return rows


def write_data(step_dir: Path) -> list[dict[str, str]]:
    """`data/train.json` and `data/eval.json` (JSON lines) for `--data_path local/jsonfile`; returns the train rows."""
    rng = random.Random(0)
    data = step_dir / "data"
    data.mkdir(parents=True, exist_ok=True)
    train, evaluation = _rows(rng, _TRAIN_ROWS), _rows(rng, _EVAL_ROWS)
    for name, rows in (("train", train), ("eval", evaluation)):
        (data / f"{name}.json").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return train


def write_tokenizer(model_dir: Path, rows: list[dict[str, str]]) -> int:
    """A byte-level BPE trained on `rows`, saved as OPT's tokenizer is (GPT-2 files, `</s>` bos/eos); its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [f" {r['prompt']} {r[answer]}" for r in rows for answer in ("chosen", "rejected")]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_BPE_VOCAB,
        special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    model_dir.mkdir(parents=True, exist_ok=True)
    bpe.model.save(str(model_dir))  # vocab.json, merges.txt
    config = {
        "tokenizer_class": "GPT2Tokenizer",
        "add_bos_token": True,
        "add_prefix_space": False,
        "bos_token": "</s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "errors": "replace",
        "model_max_length": 2048,
    }
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return bpe.get_vocab_size()


def _opt_config(vocab_size: int) -> object:
    from transformers import OPTConfig

    return OPTConfig(
        vocab_size=8 * math.ceil(vocab_size / 8),  # DeepSpeed-Chat resizes to a multiple of 8: nothing to resize
        hidden_size=_HIDDEN,
        word_embed_proj_dim=_HIDDEN,
        num_hidden_layers=_LAYERS,
        num_attention_heads=_HEADS,
        ffn_dim=_FFN,
        max_position_embeddings=128,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        pad_token_id=1,
        bos_token_id=2,
        eos_token_id=2,
    )


def write_actor(model_dir: Path, vocab_size: int) -> None:
    """The tiny OPT causal LM, from a fixed seed, saved with `save_pretrained` beside its tokenizer."""
    import torch
    from transformers import OPTForCausalLM

    torch.manual_seed(0)
    model = OPTForCausalLM(_opt_config(vocab_size))
    model.generation_config.do_sample = False
    model.save_pretrained(model_dir)


def write_critic(critic_dir: Path, vocab_size: int) -> None:
    """A reward-model checkpoint as step 2 saves it: `config.json` and `pytorch_model.bin` of `RewardModel`'s keys."""
    import torch
    from transformers import OPTModel

    torch.manual_seed(1)
    config = _opt_config(vocab_size)
    trunk = OPTModel(config)
    state = {f"rwtransformer.{name}": tensor for name, tensor in trunk.state_dict().items()}
    state["v_head.weight"] = torch.randn(1, _HIDDEN) * 0.5
    critic_dir.mkdir(parents=True, exist_ok=True)
    torch.save(state, critic_dir / "pytorch_model.bin")
    config.to_json_file(critic_dir / "config.json")


def prepare_step(step: int, source_dir: Path, work_dir: Path) -> Path:
    """Edit the exported DeepSpeed-Chat in `work_dir` for step `step`; returns the step's folder to run in."""
    del source_dir  # everything is read from the copy in work_dir
    _edit_sources(work_dir, step)
    step_dir = work_dir / STEP_DIRS[step]
    link = step_dir / "dschat"
    if not link.exists():
        os.symlink(os.path.relpath(work_dir / "dschat", step_dir), link)
    rows = write_data(step_dir)
    vocab = write_tokenizer(step_dir / MODEL_DIR, rows)
    write_actor(step_dir / MODEL_DIR, vocab)
    if step == 3:
        write_critic(step_dir / CRITIC_DIR, vocab)
    return step_dir


# The options every step's main.py takes alike: the local data, its split and cache folder, the seed.
_DATA = {"data_path": "local/jsonfile", "data_split": "2,4,4", "data_output_path": "data_files", "seed": 1234}
_SCHEDULE = {"gradient_accumulation_steps": 1, "lr_scheduler_type": "cosine", "num_warmup_steps": 0}


def _main_py(options: dict[str, object], *switches: str) -> tuple[str, ...]:
    """`deepspeed --num_gpus 2 main.py`, then `--key value` per option in order, then the bare switches."""
    pairs = (item for key, value in options.items() for item in (f"--{key}", str(value)))
    return (LAUNCHER, "--num_gpus", "2", "main.py", *pairs, "--deepspeed", "--output_dir", "output", *switches)


def _step1(zero: int, dtype: str, *extra: str) -> tuple[str, ...]:
    options = {
        **_DATA,
        **_SCHEDULE,
        "model_name_or_path": MODEL_DIR,
        "per_device_train_batch_size": 2,
        "per_device_eval_batch_size": 2,
        "max_seq_len": 32,
        "learning_rate": "1e-3",
        "weight_decay": 0.1,
        "num_train_epochs": 1,
        "zero_stage": zero,
        "dtype": dtype,
    }
    return _main_py(options, "--print_loss", *extra)


def _step2(zero: int, dtype: str, *extra: str) -> tuple[str, ...]:
    options = {
        **_DATA,
        **_SCHEDULE,
        "model_name_or_path": MODEL_DIR,
        "num_padding_at_beginning": 1,
        "per_device_train_batch_size": 2,
        "per_device_eval_batch_size": 2,
        "max_seq_len": 32,
        "learning_rate": "5e-3",
        "weight_decay": 0.1,
        "num_train_epochs": 2,
        "dropout": 0.0,
        "zero_stage": zero,
        "dtype": dtype,
    }
    return _main_py(options, *extra)


def _step3(actor_zero: int, critic_zero: int, dtype: str, *extra: str) -> tuple[str, ...]:
    options = {
        **_DATA,
        **_SCHEDULE,
        "actor_model_name_or_path": MODEL_DIR,
        "critic_model_name_or_path": CRITIC_DIR,
        "num_padding_at_beginning": 1,
        "per_device_generation_batch_size": 2,
        "per_device_training_batch_size": 2,
        "generation_batches": 1,
        "ppo_epochs": 1,
        "max_answer_seq_len": 8,
        "max_prompt_seq_len": 16,
        "actor_learning_rate": "1e-3",
        "critic_learning_rate": "1e-3",
        "num_train_epochs": 1,
        "actor_weight_decay": 0,
        "critic_weight_decay": 0,
        "actor_dropout": 0.0,
        "actor_zero_stage": actor_zero,
        "critic_zero_stage": critic_zero,
        "dtype": dtype,
        "test_stop_step": 4,
    }
    return _main_py(options, "--enable_test_mode", *extra)


def programs() -> list[Program]:
    """One program per DeepSpeed-Chat step and configuration, each on 2 CPU ranks."""
    step1, step2, step3 = (partial(prepare_step, n) for n in (1, 2, 3))
    lora1 = ("--lora_dim", "8", "--lora_module_name", "decoder.layers.", "--only_optimize_lora")
    return [
        Program(
            name="chat-step1-lora-zero3-offload-bf16",
            source=SOURCE,
            prepare=step1,
            argv=_step1(3, "bf16", "--offload", "--gradient_checkpointing", *lora1),
            loss_pattern=STEP1_LOSS,
            env=_ENV,
        ),
        Program(
            # DeepSpeed-Chat's default dtype. DeepSpeed 0.19.8 refuses fp16 on a CPU without oneDNN fp16
            # (its CPU accelerator's is_fp16_supported()); ds runs it.
            name="chat-step1-lora-zero3-offload-fp16",
            source=SOURCE,
            prepare=step1,
            argv=_step1(3, "fp16", "--offload", "--gradient_checkpointing", *lora1),
            loss_pattern=STEP1_LOSS,
            env=_ENV,
        ),
        Program(
            name="chat-step1-zero2-bf16",
            source=SOURCE,
            prepare=step1,
            argv=_step1(2, "bf16"),
            loss_pattern=STEP1_LOSS,
            env=_ENV,
        ),
        Program(
            name="chat-step2-zero2-bf16",
            source=SOURCE,
            prepare=step2,
            argv=_step2(2, "bf16"),
            loss_pattern=STEP2_LOSS,
            env=_ENV,
        ),
        Program(
            name="chat-step2-zero3-offload-bf16",
            source=SOURCE,
            prepare=step2,
            argv=_step2(3, "bf16", "--offload", "--gradient_checkpointing"),
            loss_pattern=STEP2_LOSS,
            env=_ENV,
        ),
        Program(
            name="chat-step3-zero2-hybrid-lora-bf16",
            source=SOURCE,
            prepare=step3,
            argv=_step3(2, 2, "bf16", "--enable_hybrid_engine", "--actor_lora_dim", "8"),
            loss_pattern=STEP3_LOSS,
            env=_ENV,
        ),
        Program(
            name="chat-step3-zero3-offload-hybrid-bf16",
            source=SOURCE,
            prepare=step3,
            argv=_step3(3, 3, "bf16", "--enable_hybrid_engine", "--offload", "--actor_gradient_checkpointing"),
            loss_pattern=STEP3_LOSS,
            env=_ENV,
        ),
    ]
