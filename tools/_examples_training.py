"""Recipes for DeepSpeedExamples' `training/` programs, each made to run offline on a 2-core CPU host in minutes.

The edits are the fewest that let a program run here, each for a stated reason:
- downloads become local files or seeded synthetic data (the offline `torchvision` stand-in; `ds_offline.py`
  writes a word-level tokenizer, a tiny Llama and text sets that `from_pretrained`/`load_dataset` read as is);
- sizes shrink through the program's own arguments (layers, widths, steps, sequence length) wherever it has them;
- CUDA-only calls (`torch.cuda.set_device`, a hard-coded `cuda:N` device) become their CPU equivalents;
- where a program prints no loss, one print of the loss it computes; where it seeds nothing, one
  `torch.manual_seed` before the model is built, so two stacks can be compared loss for loss.
Nothing else in the program changes: its config, its training loop and its DeepSpeed calls run as written.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from _examples_edit import add_shims, between, edit_json, substitute
from _examples_program import LAUNCHER, PYTHON, Program

_HF_OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


# --- training/cifar -------------------------------------------------------------------------------------------


def _prepare_cifar(source_dir: Path, work_dir: Path) -> Path:
    substitute(
        work_dir / "cifar10_deepspeed.py",
        "    net = Net(args)\n",
        "    torch.manual_seed(0)  # offline run: the same initial weights on every run\n    net = Net(args)\n",
    )
    add_shims(work_dir, "torchvision")
    return work_dir


_CIFAR = (LAUNCHER, "--num_gpus", "2", "cifar10_deepspeed.py", "--deepspeed", "--epochs", "1", "--log-interval", "4")
_CIFAR_LOSS = r"\] loss:\s*([-+\d.eE]+|nan|inf)"
# run_ds_moe.sh's expert options; run_ds_prmoe.sh's differ in --num-experts '2 4' and --mlp-type residual.
_MOE = ("--moe", "--ep-world-size", "2", "--top-k", "1", "--noisy-gate-policy", "RSample", "--moe-param-group")


def _cifar(name: str, *args: str, notes: str = "") -> Program:
    return Program(
        name=name,
        source="training/cifar",
        prepare=_prepare_cifar,
        argv=(*_CIFAR, *args),
        loss_pattern=_CIFAR_LOSS,
        notes="512 synthetic CIFAR-10 images, 1 epoch (32 steps); "
        + ("fp32. " if "fp32" in args else "bf16 (fp16, the default, needs a GPU). ")
        + notes,
        timeout_s=600,
    )


# --- training/pipeline_parallelism ----------------------------------------------------------------------------


def _prepare_pipeline(source_dir: Path, work_dir: Path) -> Path:
    train = work_dir / "train.py"
    substitute(train, "transforms.Resize(256)", "transforms.Resize(72)")
    substitute(train, "transforms.CenterCrop(224)", "transforms.CenterCrop(64)")
    substitute(train, "    torch.cuda.set_device(args.local_rank)\n", "")
    substitute(
        train,
        "        loss = engine.train_batch()\n",
        "        loss = engine.train_batch()\n"
        "        if dist.get_rank() == 0:\n"
        "            print(f'pipe step {step} loss {loss.item()}', flush=True)\n",
    )
    edit_json(work_dir / "ds_config.json", {"train_batch_size": 16})
    add_shims(work_dir, "torchvision")
    return work_dir


def _pipeline(name: str, prepare: Callable[[Path, Path], Path], notes: str) -> Program:
    """training/pipeline_parallelism's train.py at 2 stages for 6 steps, prepared by `prepare`."""
    return Program(
        name=name,
        source="training/pipeline_parallelism",
        prepare=prepare,
        argv=(LAUNCHER, "--num_gpus", "2", "train.py", "--deepspeed_config=ds_config.json", "-p", "2")
        + ("--steps=6", "--backend", "gloo"),
        loss_pattern=r"pipe step \d+ loss ([-+\d.eE]+|nan|inf)",
        notes=notes,
        timeout_s=900,
    )


def _prepare_pipeline_noclip(source_dir: Path, work_dir: Path) -> Path:
    """The same program with gradient clipping off (DeepSpeed 0.19.8's default `gradient_clipping` is 1.0).

    DeepSpeed's pipeline clips by the norm of the first stage's gradients only: its `clip_grad_norm_` counts a
    parameter only on model-parallel rank 0, and the pipeline grid reports the stage as that rank. ds clips by
    the norm over every stage. With clipping off, both compute the same update, so this variant shows whether
    the pipeline itself (schedule, data order, loss) matches.
    """
    run_dir = _prepare_pipeline(source_dir, work_dir)
    edit_json(run_dir / "ds_config.json", {"gradient_clipping": 0.0}, new_keys=True)
    return run_dir


# --- training/HelloDeepSpeed ----------------------------------------------------------------------------------

_BERT_SIZE = "--max_seq_length 32 --num_layers 2 --num_heads 2 --ff_dim 64 --h_dim 32 --batch_size 8 --log_every 1"
# Phase 1 trains steps 1-6 and saves at 3, 6 and on leaving the loop; phase 2 loads the latest and trains to 11.
_BERT_RESUME = (
    f"{LAUNCHER} --num_gpus 1 train_bert_ds.py --checkpoint_dir experiments --tokenizer ./tiny-tokenizer "
    f"{_BERT_SIZE} --num_iterations 7 --checkpoint_every 3 && echo '=== resume' && "
    f"{LAUNCHER} --num_gpus 1 train_bert_ds.py --load_checkpoint_dir experiments/bert_pretrain.* "
    "--num_iterations 12 --log_every 1"
)


def _prepare_bert(source_dir: Path, work_dir: Path) -> Path:
    add_shims(work_dir, "ds_offline.py")
    return work_dir


# --- training/bf16_master_weight ------------------------------------------------------------------------------


def _prepare_bf16(source_dir: Path, work_dir: Path) -> Path:
    train = work_dir / "train.py"
    substitute(train, "    torch.cuda.set_device(local_rank)\n", "")
    substitute(train, "    torch.cuda.reset_peak_memory_stats()\n", "")
    substitute(train, 'torch.autocast(device_type="cuda"', 'torch.autocast(device_type="cpu"')
    return work_dir


_BF16 = (
    *(LAUNCHER, "--num_gpus", "2", "train.py", "--num_layers", "2", "--hidden_dim", "64", "--num_heads", "4"),
    *("--vocab_size", "512", "--batch_size", "4", "--seq_length", "32", "--num_steps", "8", "--warmup_steps", "2"),
    *("--log_interval", "1", "--deepspeed_config"),
)


def _bf16(name: str, config: str) -> Program:
    return Program(
        name=name,
        source="training/bf16_master_weight",
        prepare=_prepare_bf16,
        argv=(*_BF16, config),
        loss_pattern=r"\[Rank 0\] Step \d+: loss=([-+\d.eE]+|nan|inf)",
        notes="2 layers, hidden 64, 8 steps; torch.autocast on the CPU instead of CUDA.",
        timeout_s=600,
    )


# --- training/tensor_parallel/basic_example -------------------------------------------------------------------


def _prepare_autotp(source_dir: Path, work_dir: Path) -> Path:
    run_dir = work_dir / "basic_example"
    script = run_dir / "autotp_example.py"
    substitute(script, 'torch.device(f"cuda:{rank % torch.cuda.device_count()}")', 'torch.device("cpu")')
    substitute(
        script,
        "    vocab_size = model.config.vocab_size\n",
        "    torch.manual_seed(0)\n    vocab_size = model.config.vocab_size\n",
    )
    substitute(
        script,
        "        engine.step()\n",
        "        engine.step()\n"
        "        if rank == 0:\n"
        "            print(f'step loss {outputs.loss.item()}', flush=True)\n",
    )
    add_shims(run_dir, "ds_offline.py")
    return run_dir


# --- training/DeepSpeed-SuperOffload --------------------------------------------------------------------------


def _prepare_superoffload(source_dir: Path, work_dir: Path) -> Path:
    script = (work_dir / "finetune_llama-8b_1gpu.sh").read_text()
    config = between(script, 'if [ "$MODE" = "superoffload" ]; then\ncat > "$DS_CONFIG_JSON" << EOF\n', "\nEOF", script)
    (work_dir / "superoffload_config.json").write_text(config.replace("$BATCH_SIZE", "2"))
    add_shims(work_dir, "ds_offline.py", "wandb.py")
    return work_dir


# --- training/offload_states ----------------------------------------------------------------------------------


def _prepare_offload_states(source_dir: Path, work_dir: Path) -> Path:
    script = work_dir / "offload_states.py"
    # On a CPU host the accelerator's memory_allocated() is the process RSS, which moving state from CPU to CPU
    # does not lower: the program's two "memory fell / rose" asserts test a GPU, not the offload.
    substitute(
        script,
        "        assert alloc_after_offload < alloc_before_offload, "
        'f"Allocated memory should decrease after offload"\n',
        "",
    )
    substitute(
        script,
        "        assert alloc_after_offload < get_accelerator().memory_allocated(\n"
        '        ), f"Allocated memory should increase after offload back"\n',
        "",
    )
    substitute(
        script,
        "        model.step()\n",
        "        model.step()\n"
        "        if dist.get_rank() == 0:\n"
        "            print(f'loss {loss.item()}', flush=True)\n",
    )
    return work_dir


def programs() -> list[Program]:
    """Every `training/` recipe, in the order the table lists them."""
    return [
        _cifar("cifar10-zero2", "--dtype", "bf16", "--stage", "2"),
        _cifar("cifar10-zero3", "--dtype", "bf16", "--stage", "3"),
        # fp32: the sides' losses can agree to the last printed digit (bf16 rounding hides 1-ulp differences).
        _cifar("cifar10-zero2-fp32", "--dtype", "fp32", "--stage", "2"),
        _cifar("cifar10-zero3-fp32", "--dtype", "fp32", "--stage", "3"),
        _cifar("cifar10-moe", "--dtype", "bf16", *_MOE, "--num-experts", "2", notes="run_ds_moe.sh's options."),
        _cifar(
            "cifar10-moe-zero2",
            *("--dtype", "bf16", "--stage", "2", *_MOE, "--num-experts", "2"),
            notes="run_ds_moe.sh's options at ZeRO-2.",
        ),
        _cifar(
            "cifar10-prmoe",
            *("--dtype", "bf16", *_MOE, "--num-experts", "2", "4", "--mlp-type", "residual"),
            notes="run_ds_prmoe.sh's options (2 + 4 experts, residual MLP).",
        ),
        _pipeline(
            "pipeline-alexnet",
            _prepare_pipeline,
            "2 stages; 64x64 crops, train_batch_size 16 (2 micro-batches of 8), 6 steps; prints train_batch()'s loss.",
        ),
        _pipeline(
            "pipeline-alexnet-noclip",
            _prepare_pipeline_noclip,
            "pipeline-alexnet with gradient_clipping 0 (DeepSpeed clips a pipeline by stage 0's gradient norm "
            "alone; ds by every stage's).",
        ),
        Program(
            name="hellodeepspeed-bert-resume",
            source="training/HelloDeepSpeed",
            prepare=_prepare_bert,
            setup=(
                (PYTHON, "ds_offline.py", "tokenizer", "tiny-tokenizer"),
                (PYTHON, "ds_offline.py", "text", "wikitext", "--config", "wikitext-2-v1"),
            ),
            argv=("bash", "-c", _BERT_RESUME),
            loss_pattern=r"\[Rank 0\] Loss: ([-+\d.eE]+|nan|inf)",
            requirements=("fire", "termcolor", "loguru", "pytz", "sh", "tensorboard", "tensorboard-data-server")
            + ("protobuf", "absl-py", "markdown", "werkzeug", "grpcio", "markupsafe", "six"),
            env=_HF_OFFLINE,
            notes="bf16, ZeRO-1, optimizer offloaded to the CPU; 6 steps, checkpoint, then resume from it for 4 more. "
            "1 rank: the program names its checkpoint folder by each rank's clock second, so 2 ranks may write 2 "
            "folders. Its running-mean 'Loss' restarts with the resumed run.",
            timeout_s=900,
        ),
        _bf16("bf16-master-baseline", "configs/baseline.json"),
        _bf16("bf16-master-full", "configs/bf16_full.json"),
        Program(
            name="autotp-basic",
            source="training/tensor_parallel",
            prepare=_prepare_autotp,
            setup=((PYTHON, "ds_offline.py", "llama", "tiny-llama"),),
            argv=(LAUNCHER, "--num_gpus", "2", "autotp_example.py", "--model_name", "./tiny-llama", "--tp_size", "2")
            + ("--dp_size", "1", "--batch_size", "2", "--seq_length", "32", "--num_steps", "5", "--precision", "bf16"),
            loss_pattern=r"step loss ([-+\d.eE]+|nan|inf)",
            env=_HF_OFFLINE,
            notes="tiny Llama (2 layers, hidden 64), TP 2 x DP 1, ZeRO-2, bf16, 5 steps.",
            timeout_s=600,
        ),
        Program(
            name="variable-batch-size-and-lr",
            source="training/data_efficiency/variable_batch_size_and_lr",
            prepare=lambda source_dir, work_dir: work_dir,
            # Its argparse takes no --local_rank, which both launchers append by default.
            argv=(LAUNCHER, "--num_gpus", "2", "--no_local_rank", "variable_batch_size_and_lr_example.py"),
            loss_pattern=r"epoch \d+, batch \d+, loss ([-+\d.eE]+|nan|inf)",
            notes="as written (its model and data are already small and synthetic); launched with --no_local_rank, "
            "as its argument parser takes no --local_rank.",
            timeout_s=600,
        ),
        Program(
            name="superoffload-finetune",
            source="training/DeepSpeed-SuperOffload",
            prepare=_prepare_superoffload,
            setup=(
                (PYTHON, "ds_offline.py", "llama", "tiny-llama"),
                (PYTHON, "ds_offline.py", "alpaca", "alpaca", "--rows", "64"),
            ),
            argv=(LAUNCHER, "--num_gpus", "1", "finetune_zero3.py", "--deepspeed_config=superoffload_config.json")
            + ("--model_name", "./tiny-llama", "--num_train_epochs", "1", "--lr", "1e-3", "--batch_size", "2")
            + ("--output_dir", "out", "--seed", "42", "--max_length", "64", "--log_interval", "1")
            + ("--dataset_name", "./alpaca", "--bench_steps", "6", "--warmup_steps", "1")
            + ("--activation_checkpointing", "--attn_implementation", "eager"),
            loss_pattern=r"Step\s+\d+ \| Loss: ([-+\d.eE]+|nan|inf)",
            env=_HF_OFFLINE,
            notes="finetune_llama-8b_1gpu.sh's superoffload config (batch 2) on a tiny Llama, 64 Alpaca-shaped "
            "rows, 6 steps, eager attention.",
            timeout_s=900,
        ),
        Program(
            name="offload-states",
            source="training/offload_states",
            prepare=_prepare_offload_states,
            argv=(LAUNCHER, "--num_gpus", "2", "offload_states.py", "--hidden_dim", "256", "--nlayers", "2")
            + ("--iteration", "6", "--warmup", "2"),
            loss_pattern=r"^loss ([-+\d.eE]+|nan|inf)",
            deterministic=False,
            notes="ZeRO-3 bf16, hidden 256, 6 steps, each followed by offload_states + reload_states; the "
            "GPU-memory asserts removed. Unseeded (model and data), so losses differ run to run.",
            timeout_s=600,
        ),
    ]
