"""The README's main job: train the example GPT with ZeRO-2 on 2 CPU ranks through `deepspeed`, then consolidate.

Run with `nox -s demo` (installs what it needs) or, in an environment with ds installed,
`python examples/demo.py [--seconds 60] [--out runs/demo]`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from data import VOCAB, CharDataset, decode, encode  # noqa: E402
from gpt import GPT, GPTConfig, param_count  # noqa: E402

DEFAULT_MASTER_PORT = 29500


def _run(cmd: list[str]) -> None:
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def _tool(name: str) -> str:
    """The console script installed next to this Python (the nox venv's), else whatever PATH finds."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else name


def _master_port() -> int:
    """DeepSpeed's default port, or a free one when something else on this host already listens there."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", DEFAULT_MASTER_PORT))
            return DEFAULT_MASTER_PORT
        except OSError:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]


def _sample(model: GPT, prompt: str, length: int = 60) -> str:
    idx = encode(prompt)[None]
    model.eval()
    with torch.no_grad():
        for _ in range(length):
            logits = model(idx[:, -model.cfg.block_size :])
            idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return decode(idx[0])


def _held_out_loss(model: GPT) -> float:
    """The loss on train_gpt.py's fixed held-out batch (the corpus' first 16 windows)."""
    dataset = CharDataset(block_size=model.cfg.block_size)
    x, y = (torch.stack(t) for t in zip(*(dataset[i] for i in range(16)), strict=True))
    model.eval()
    with torch.no_grad():
        return model(x, y).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="training time budget")
    parser.add_argument("--out", type=Path, default=Path("runs/demo"), help="checkpoint directory")
    args = parser.parse_args()
    log_file = args.out.with_name(args.out.name + "_log.jsonl")
    shutil.rmtree(args.out, ignore_errors=True)
    log_file.unlink(missing_ok=True)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    _run(
        [
            _tool("deepspeed"),
            "--num_gpus",
            "2",
            "--master_port",
            str(_master_port()),
            str(HERE / "train_gpt.py"),
            "--deepspeed_config",
            str(HERE / "ds_config_zero2.json"),
            "--steps",
            "100000",
            "--seconds",
            str(args.seconds),
            "--save_dir",
            str(args.out),
            "--log_json",
            str(log_file),
        ]
    )
    trained = time.perf_counter()
    fp32_dir = args.out / "fp32"
    _run([_tool("ds-zero-to-fp32"), str(args.out), str(fp32_dir)])
    fp32_file = fp32_dir / "pytorch_model.bin"
    # A 0.8M-parameter model evaluated one sequence at a time: extra threads only add synchronisation
    # (tens of seconds of it for the sample on a busy 2-core machine).
    torch.set_num_threads(1)
    model = GPT(GPTConfig(vocab_size=len(VOCAB)))
    model.load_state_dict(torch.load(fp32_file, weights_only=True))

    log = [json.loads(line) for line in log_file.read_text().splitlines() if line.strip()]
    losses = [(e["step"], e["loss"]) for e in log if "loss" in e]
    saved_eval = [e["eval_loss"] for e in log if "eval_loss" in e][-1]
    (first_step, first), (last_step, last) = losses[0], losses[-1]
    print(f"\ndone in {time.perf_counter() - started:.0f} s ({trained - started:.0f} s launch + training)")
    print(
        f"  training loss:       {first:.3f} at step {first_step} -> {last:.3f} at step {last_step} "
        f"(ZeRO-2, 2 CPU ranks; per-step log: {log_file.resolve()})"
    )
    print(f"  checkpoint:          {args.out.resolve()} (latest tag: {(args.out / 'latest').read_text().strip()})")
    print(f"  consolidated fp32:   {fp32_file.resolve()} ({param_count(model) / 1e6:.2f}M params)")
    print(
        f"  held-out loss:       {_held_out_loss(model):.4f} from the fp32 file, {saved_eval:.4f} from the "
        "trained engine"
    )
    print(f"  sample from the model: {_sample(model, 'the cat ')!r}")


if __name__ == "__main__":
    main()
