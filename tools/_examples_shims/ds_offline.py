"""Builds on disk what the DeepSpeedExamples programs would download: a tokenizer, a tiny model, text sets.

    python ds_offline.py tokenizer DIR
    python ds_offline.py llama DIR [--hidden 64 --layers 2 --heads 4 --kv-heads 2]
    python ds_offline.py text DIR --config NAME [--rows 256]
    python ds_offline.py alpaca DIR [--rows 64]

A program is then pointed at DIR where it takes a hub name (`--model_name ./tiny-llama`), and its loading
code (`AutoTokenizer.from_pretrained`, `AutoModelForCausalLM.from_pretrained`, `datasets.load_dataset`) runs
unchanged. Everything is seeded: each side of a comparison builds the same files, so the programs see the same
tokens and the same initial weights. Text is drawn from a made-up vocabulary of two-syllable words with a few
recurring phrases, so a language model's loss has something to fall to.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

#: Special tokens and their ids; RoBERTa's layout (bos 0, pad 1, eos 2), which HelloDeepSpeed's config assumes.
SPECIALS = ("<s>", "<pad>", "</s>", "<unk>", "<mask>")
_SYLLABLES = ("ba", "ko", "mi", "tu", "ren", "sa", "lo", "vi", "da", "pe", "nu", "gor", "fi", "ta", "xe", "zu")
WORDS = tuple(a + b for a in _SYLLABLES for b in _SYLLABLES)


def sentences(rows: int, seed: int) -> list[str]:
    """`rows` sentences of 6-24 words; a third of them repeat one of eight phrases."""
    rng = random.Random(seed)
    phrases = [" ".join(rng.choice(WORDS) for _ in range(6)) for _ in range(8)]
    out = []
    for _ in range(rows):
        words = [rng.choice(WORDS) for _ in range(rng.randint(6, 24))]
        if rng.random() < 0.34:
            words[:6] = rng.choice(phrases).split()
        out.append(" ".join(words))
    return out


def write_tokenizer(folder: Path) -> None:
    """A word-level fast tokenizer over `WORDS` (+ `SPECIALS`), saved as `AutoTokenizer` loads it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate((*SPECIALS, *WORDS))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        mask_token="<mask>",
        model_max_length=512,
    )
    tokenizer.save_pretrained(str(folder))


def write_llama(folder: Path, hidden: int, layers: int, heads: int, kv_heads: int) -> None:
    """A randomly initialised (seed 0) Llama of the given size and the tokenizer, as a `from_pretrained` folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    write_tokenizer(folder)
    config = LlamaConfig(
        vocab_size=len(SPECIALS) + len(WORDS),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        bos_token_id=0,
        pad_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(folder))


def write_text(folder: Path, config: str, rows: int) -> None:
    """A local dataset folder `load_dataset(folder, config, split="train")` reads: one jsonl, declared in README.md."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = sentences(rows, seed=7)
    # Blank rows as wikitext has them (its programs filter them out).
    records = [{"text": text if i % 9 else ""} for i, text in enumerate(lines)]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "README.md").write_text(
        f"---\nconfigs:\n- config_name: {config}\n  data_files:\n  - split: train\n    path: train.jsonl\n---\n"
    )


def write_alpaca(folder: Path, rows: int) -> None:
    """An instruction set with Alpaca's columns (instruction, input, output) as `train.json`."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = sentences(3 * rows, seed=11)
    records = [
        {"instruction": lines[3 * i], "input": lines[3 * i + 1] if i % 2 else "", "output": lines[3 * i + 2]}
        for i in range(rows)
    ]
    (folder / "train.json").write_text(json.dumps(records))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("tokenizer", "llama", "text", "alpaca"))
    parser.add_argument("folder", type=Path)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--config", default="default")
    parser.add_argument("--rows", type=int, default=256)
    args = parser.parse_args()
    if args.what == "tokenizer":
        write_tokenizer(args.folder)
    elif args.what == "llama":
        write_llama(args.folder, args.hidden, args.layers, args.heads, args.kv_heads)
    elif args.what == "text":
        write_text(args.folder, args.config, args.rows)
    else:
        write_alpaca(args.folder, args.rows)


if __name__ == "__main__":
    main()
