"""One rank of a Hugging Face `Trainer` job: a tiny Llama (built from a config) on fixed random tokens.

Run under `torchrun --nproc_per_node 2` (or the `deepspeed` launcher). With `--ds_config` the Trainer
runs through `deepspeed` (ds here); without it, plain PyTorch DDP. Rank 0 writes a JSON summary:
the per-step losses the Trainer logged, the final learning rates, and a checksum of the final weights.

    --init_dir DIR         load the model with `from_pretrained(DIR)` (under ZeRO-3: inside zero.Init)
    --save_steps N         checkpoint every N optimizer steps into --out_dir
    --resume CKPT          `trainer.train(resume_from_checkpoint=CKPT)`
    --save_model DIR       `trainer.save_model(DIR)` at the end
"""

from __future__ import annotations

import argparse
import json
import os
import resource

import torch
from job_exit import leave
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import Dataset
from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainingArguments

VOCAB, SEQ, SAMPLES = 64, 16, 64
LR, WARMUP, BETAS, EPS, WEIGHT_DECAY = 5e-3, 2, (0.9, 0.999), 1e-8, 0.01


def tiny_config(hidden: int = 32, layers: int = 2) -> LlamaConfig:
    """A Llama of `layers` blocks of width `hidden` (the tests use the default; the benchmark a wider one)."""
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )


class Tokens(Dataset):
    """Fixed random token sequences (seeded), next-token labels."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def deepspeed_warmup_decay(total: int, warmup: int):
    """DeepSpeed 0.19.8's WarmupDecayLR (linear warmup, min lr 0) as a LambdaLR factor, for the DDP reference.

    DeepSpeed's schedule starts at iteration -1 (lr = min lr for the first update) and steps after each
    update, so update k (from 0) runs at gamma(k - 1): gamma(i) = i / w during warmup (w >= 2), then
    max(0, (total - i) / max(1, total - w)).
    """
    w = max(2, warmup)

    def factor(k: int) -> float:
        i = k - 1
        if i < 0:
            return 0.0
        if i < w:
            return i / w
        return max(0.0, (total - i) / max(1.0, total - w))

    return factor


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ds_config", default=None)
    p.add_argument("--init_dir", required=True)
    p.add_argument("--out_dir", required=True)
    p.add_argument("--summary", required=True)
    p.add_argument("--max_steps", type=int, default=8)
    p.add_argument("--save_steps", type=int, default=0)
    p.add_argument("--resume", default=None)
    p.add_argument("--save_model", default=None)
    p.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher passes it
    a = p.parse_args()

    args = TrainingArguments(
        output_dir=a.out_dir,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=a.max_steps,
        learning_rate=LR,
        warmup_steps=WARMUP,
        weight_decay=WEIGHT_DECAY,
        adam_beta1=BETAS[0],
        adam_beta2=BETAS[1],
        adam_epsilon=EPS,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="steps" if a.save_steps else "no",
        save_steps=a.save_steps or 500,
        report_to=[],
        seed=0,
        data_seed=0,
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        deepspeed=a.ds_config,
        ddp_backend="gloo",
    )
    # After TrainingArguments: with a ZeRO-3 config, from_pretrained now builds the model inside zero.Init.
    model = AutoModelForCausalLM.from_pretrained(a.init_dir, dtype=torch.float32)
    # Under ZeRO-3 every parameter is a 1/N shard from here on (`ds_tensor`), the full shape kept on `ds_shape`.
    partitioned_at_load = all(hasattr(q, "ds_tensor") and q.ds_tensor.numel() < q.ds_numel for q in model.parameters())
    optimizers = (None, None)
    if a.ds_config is None:  # the reference: what the ds_config asks DeepSpeed for, built with torch
        opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
        optimizers = (opt, LambdaLR(opt, deepspeed_warmup_decay(a.max_steps, WARMUP)))
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), optimizers=optimizers)
    metrics = trainer.train(resume_from_checkpoint=a.resume).metrics
    if a.save_model:
        trainer.save_model(a.save_model)

    losses = {int(h["step"]): h["loss"] for h in trainer.state.log_history if "loss" in h}
    engine = trainer.model_wrapped
    basic = getattr(engine, "basic_optimizer", None)
    lrs = [g["lr"] for g in trainer.optimizer.param_groups]
    checksum = _weights_checksum(trainer)
    # peak resident memory of each rank (Linux reports KiB), gathered so rank 0 can report the largest
    peak_rss = [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024]
    if torch.distributed.is_initialized():
        every: list[list[float]] = [[] for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather_object(every, peak_rss)
        peak_rss = [r[0] for r in every]
    if int(os.environ.get("RANK", "0")) == 0:
        with open(a.summary, "w") as f:
            json.dump(
                {
                    "losses": losses,
                    "lrs": lrs,
                    "checksum": checksum,
                    "global_step": trainer.state.global_step,
                    "deepspeed": trainer.is_deepspeed_enabled,
                    "partitioned_at_load": partitioned_at_load,
                    "basic_optimizer": type(basic).__name__ if basic is not None else None,
                    "cpu_offload": engine.zero_cpu_offload() if trainer.is_deepspeed_enabled else None,
                    "train_runtime_s": metrics["train_runtime"],
                    "peak_rss_mib": peak_rss,
                },
                f,
            )
    leave()


def _weights_checksum(trainer: Trainer) -> float:
    """Sum of |w| over the full weights (gathered under ZeRO-3), in float64."""
    model = trainer.model_wrapped if trainer.is_deepspeed_enabled else trainer.model
    module = getattr(model, "module", model)
    params = list(module.parameters())
    if trainer.is_deepspeed_enabled:
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, enabled=any(hasattr(q, "ds_id") for q in params)):
            return float(sum(q.detach().double().abs().sum() for q in params))
    return float(sum(q.detach().double().abs().sum() for q in params))


if __name__ == "__main__":
    main()
