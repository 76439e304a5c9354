"""The README's main job: train the example GPT with ZeRO-2 on 2 CPU ranks through `deepspeed`, then consolidate.

Run with `nox -s demo` (installs what it needs) or, in an environment with ds installed,
`python examples/demo.py [--seconds 60]`.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from data import VOCAB, decode, encode  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402


def _run(cmd: list[str]) -> None:
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def _sample(model: GPT, prompt: str, length: int = 60) -> str:
    idx = encode(prompt)[None]
    model.eval()
    with torch.no_grad():
        for _ in range(length):
            logits = model(idx[:, -model.cfg.block_size:])
            idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return decode(idx[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="training time budget")
    parser.add_argument("--out", type=Path, default=Path("runs/demo"))
    args = parser.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    bin_dir = Path(sys.executable).parent
    deepspeed = str(bin_dir / "deepspeed") if (bin_dir / "deepspeed").exists() else "deepspeed"
    started = time.perf_counter()
    _run([deepspeed, "--num_gpus", "2", str(HERE / "train_gpt.py"),
          "--deepspeed_config", str(HERE / "ds_config_zero2.json"),
          "--steps", "100000", "--seconds", str(args.seconds), "--save_dir", str(args.out)])
    fp32_file = args.out / "fp32_state_dict.pt"
    to_fp32 = str(bin_dir / "ds-zero-to-fp32") if (bin_dir / "ds-zero-to-fp32").exists() else "ds-zero-to-fp32"
    _run([to_fp32, str(args.out), str(fp32_file)])
    model = GPT(GPTConfig(vocab_size=len(VOCAB)))
    model.load_state_dict(torch.load(fp32_file, weights_only=True))
    print(f"\ndone in {time.perf_counter() - started:.0f}s")
    print(f"  checkpoint:          {args.out.resolve()} (latest tag: {(args.out / 'latest').read_text()})")
    print(f"  consolidated fp32:   {fp32_file.resolve()}")
    print(f"  sample from the model: {_sample(model, 'the cat ')!r}")


if __name__ == "__main__":
    main()
