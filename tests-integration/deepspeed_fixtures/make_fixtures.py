"""Regenerate the DeepSpeed checkpoints the test suite reads, with the real DeepSpeed, so CI needs none.

    python tests-integration/deepspeed_fixtures/make_fixtures.py [--venv /tmp/dsref] [--cases z1_fp32 ...]
        [--keep-saves]

Makes (or reuses) an isolated venv holding only torch and the pinned DeepSpeed (`DEEPSPEED_PIN`, built
without ops: `DS_BUILD_OPS=0`; nothing of ds is visible there), then, for every case of `border_job.CASES`,
runs `border_job.py save` at 2 gloo ranks on the CPU through `torch.distributed.run`. Each case's directory
under `data/` gets DeepSpeed's checkpoint (`ckpt/`) and `continuation.json`: the losses and lr of the
steps DeepSpeed itself takes after loading that checkpoint, which ds must match.

DeepSpeed's own helper scripts (`zero_to_fp32.py`, `zero_to_torch.py`) are removed from the stored
copies: they are DeepSpeed's code. For the cases in `CONSOLIDATED_CASES` they run first, as a user runs
them from the save directory, and their output is stored beside the checkpoint: `zero_to_fp32.bin`
(`python zero_to_fp32.py . OUT`) and `zero_to_torch_bf16.bin` (`python zero_to_torch.py . OUT --dtype bf16`),
what ds's consolidation must reproduce. A case DeepSpeed cannot run on a CPU
(fp16) is recorded in `data/manifest.json` with its error instead.

Universal checkpoints: DeepSpeed's own converter (`python -m deepspeed.checkpoint.ds_to_universal
--inject_missing_state`: an engine checkpoint carries no `universal_checkpoint_info`) turns each case's
checkpoint into `universal/<tag>_universal` (plus `universal/latest_universal`), then DeepSpeed loads it
with `checkpoint.load_universal: true` at `UNIVERSAL_WORLD_SIZE` ranks (another world size than the
save) and records its continuation in `universal/continuation.json`; the outcome of each case is under
`universal` in the manifest (stage 0 has no ZeRO files, so DeepSpeed's converter refuses it). Offload
cases write the same files as their plain counterparts, so they get no universal conversion. Pipeline
cases are loaded back at `UNIVERSAL_PIPE_STAGES` stages on `UNIVERSAL_PIPE_WORLD_SIZE` ranks (another
pipeline and data-parallel degree than the save); DeepSpeed's converter refuses the 3-layer pipeline
(it needs a layer per stage between the first and the last), which the manifest records.
`--keep-saves` reuses the stored checkpoints and only remakes the universal part.

AutoTP (`autotp_job.CASES`, `tensor_parallel.autotp_size: 2` on 2 ranks): DeepSpeed's AutoTP imports
transformers, so the venv gets the pinned transformers too. DeepSpeed trains and saves at TP=2
(`ckpt/`), its converter writes `universal/<tag>_universal` (no `--inject_missing_state`: its AutoTP
records `universal_checkpoint_info`), and DeepSpeed's continuations from that universal checkpoint at
TP=1 on 1 rank and at TP=2 on 2 ranks go to `universal/continuation_tp{T}_world{N}.json`; the outcome
is under `autotp` in the manifest. One ZeRO-1 case keeps the fixtures small (about 170 KB).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DATA = HERE / "data"
DEEPSPEED_PIN = "deepspeed==0.19.8"
WORLD_SIZE = 2
UNIVERSAL_WORLD_SIZE = 1
UNIVERSAL_PIPE_STAGES = 1
UNIVERSAL_PIPE_WORLD_SIZE = 2
sys.path.insert(0, str(HERE))
from autotp_job import CASES as AUTOTP_CASES  # noqa: E402
from border_job import CASES  # noqa: E402

DEEPSPEED_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")
#: Cases whose DeepSpeed consolidations (its zero_to_fp32.py and zero_to_torch.py outputs) are stored.
CONSOLIDATED_CASES = ("z3_tied_frozen_fp32",)
#: script, its extra arguments, and the name its `pytorch_model.bin` is stored under
CONSOLIDATIONS = (
    ("zero_to_fp32.py", (), "zero_to_fp32.bin"),
    ("zero_to_torch.py", ("--dtype", "bf16"), "zero_to_torch_bf16.bin"),
)
_EXCEPTION_RE = re.compile(r"^(?:\[rank\d+\]:)?\s*(\w+(?:Error|Exception): .*)$", re.M)


def ensure_venv(venv: Path) -> Path:
    """The venv's python, with torch and the pinned DeepSpeed installed (created on first use)."""
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    probe = subprocess.run(
        [str(python), "-c", "import deepspeed, transformers, sys; sys.stdout.write(deepspeed.__version__)"],
        capture_output=True,
        text=True,
        env=_clean_env(),
    )
    if probe.returncode != 0 or probe.stdout.strip() != DEEPSPEED_PIN.split("==")[1]:
        # transformers: DeepSpeed's AutoTP imports it (the AutoTP cases).
        packages = ["torch", DEEPSPEED_PIN, "transformers"]
        subprocess.run(
            [str(python), "-m", "pip", "install", "-c", str(ROOT / "constraints.txt"), *packages],
            check=True,
            env={**_clean_env(), "DS_BUILD_OPS": "0"},
        )
    return python


def _clean_env() -> dict[str, str]:
    """The environment without PYTHONPATH (which may point at ds's sources) and on the CPU accelerator."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(
    python: Path,
    mode: str,
    case: str,
    out: Path,
    *,
    ckpt: Path | None = None,
    world_size: int = WORLD_SIZE,
    universal: bool = False,
    stages: int | None = None,
    timeout: float = 600,
) -> subprocess.CompletedProcess[str]:
    """`border_job.py MODE` under real DeepSpeed at `world_size` gloo ranks (torch.distributed.run);
    `universal` loads `ckpt` as a universal checkpoint; `stages` is a pipeline case's stage count."""
    cmd = [
        str(python),
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={world_size}",
        f"--master_port={free_port()}",
        str(HERE / "border_job.py"),
        mode,
        "--case",
        case,
        "--out",
        str(out),
    ]
    if ckpt is not None:
        cmd += ["--ckpt", str(ckpt)]
    if universal:
        cmd.append("--universal")
    if stages is not None:
        cmd += ["--stages", str(stages)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_clean_env())


def make_case(python: Path, case: str) -> dict[str, str]:
    out = DATA / case
    shutil.rmtree(out, ignore_errors=True)
    proc = run_job(python, "save", case, out, world_size=CASES[case].get("world", WORLD_SIZE))
    if proc.returncode != 0:
        shutil.rmtree(out, ignore_errors=True)
        found = _EXCEPTION_RE.findall(proc.stderr + proc.stdout)
        return {"status": "unsupported", "error": found[-1].strip() if found else proc.stderr[-300:].strip()}
    if case in CONSOLIDATED_CASES:
        consolidate(python, out)
    for script in DEEPSPEED_SCRIPTS:
        (out / "ckpt" / script).unlink(missing_ok=True)
    return {"status": "ok"}


def consolidate(python: Path, out: Path) -> None:
    """DeepSpeed's scripts in the case's save directory, run there as a user runs them; outputs kept."""
    scratch = out / "consolidated"
    for script, extra, stored in CONSOLIDATIONS:
        shutil.rmtree(scratch, ignore_errors=True)
        cmd = [str(python), script, ".", str(scratch), *extra]
        subprocess.run(cmd, cwd=out / "ckpt", check=True, capture_output=True, timeout=600, env=_clean_env())
        (scratch / "pytorch_model.bin").replace(out / stored)
    shutil.rmtree(scratch)


def _failure(proc: subprocess.CompletedProcess[str]) -> dict[str, str]:
    found = _EXCEPTION_RE.findall(proc.stderr + proc.stdout)
    error = found[-1].strip() if found else proc.stderr[-300:].strip()
    return {"status": "unsupported", "error": error.replace(f"{ROOT}/", "")}


def make_universal(python: Path, case: str) -> dict[str, str]:
    """DeepSpeed's ds_to_universal of the case's checkpoint, and DeepSpeed's continuation from it."""
    src = DATA / case / "ckpt"
    out = DATA / case / "universal"
    shutil.rmtree(out, ignore_errors=True)
    if not (src / "latest").is_file():
        return {"status": "unsupported", "error": "no DeepSpeed checkpoint for this case"}
    tag = (src / "latest").read_text().strip()
    convert = [
        str(python),
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        str(src / tag),
        "--output_folder",
        str(out / f"{tag}_universal"),
        "--inject_missing_state",
        "--num_extract_workers",
        "1",
        "--num_merge_workers",
        "1",
    ]
    proc = subprocess.run(convert, capture_output=True, text=True, timeout=600, env=_clean_env())
    if proc.returncode != 0:
        shutil.rmtree(out, ignore_errors=True)
        return _failure(proc)
    pipe = bool(CASES[case].get("pipe"))
    proc = run_job(
        python,
        "load",
        case,
        out,
        ckpt=out,
        world_size=UNIVERSAL_PIPE_WORLD_SIZE if pipe else UNIVERSAL_WORLD_SIZE,
        universal=True,
        stages=UNIVERSAL_PIPE_STAGES if pipe else None,
    )
    if proc.returncode != 0:
        shutil.rmtree(out, ignore_errors=True)
        return _failure(proc)
    return {"status": "ok"}


def run_autotp(
    python: Path, mode: str, case: str, out: Path, *, world_size: int, tp: int, ckpt: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """`autotp_job.py MODE` under real DeepSpeed at `world_size` gloo ranks and tensor-parallel degree `tp`."""
    cmd = [str(python), "-m", "torch.distributed.run", f"--nproc_per_node={world_size}", f"--master_port={free_port()}"]
    cmd += [str(HERE / "autotp_job.py"), mode, "--case", case, "--out", str(out), "--tp", str(tp)]
    if ckpt is not None:
        cmd += ["--ckpt", str(ckpt), "--universal"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=_clean_env())


def make_autotp(python: Path, case: str) -> dict[str, str]:
    """DeepSpeed's AutoTP save of `case`, its own universal conversion, and its continuations from that."""
    out = DATA / case
    shutil.rmtree(out, ignore_errors=True)
    proc = run_autotp(python, "save", case, out, world_size=2, tp=2)
    if proc.returncode != 0:
        shutil.rmtree(out, ignore_errors=True)
        return _failure(proc)
    for script in DEEPSPEED_SCRIPTS:
        (out / "ckpt" / script).unlink(missing_ok=True)
    tag = (out / "ckpt" / "latest").read_text().strip()
    universal = out / "universal"
    convert = [str(python), "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(out / "ckpt" / tag)]
    convert += ["--output_folder", str(universal / f"{tag}_universal"), "--num_extract_workers", "1"]
    proc = subprocess.run([*convert, "--num_merge_workers", "1"], capture_output=True, text=True, env=_clean_env())
    if proc.returncode != 0:
        return _failure(proc)
    for world, tp in ((1, 1), (2, 2)):
        proc = run_autotp(python, "load", case, universal, world_size=world, tp=tp, ckpt=universal)
        if proc.returncode != 0:
            return _failure(proc)
    return {"status": "ok"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=Path("/tmp/dsref"))
    parser.add_argument("--cases", nargs="*", default=sorted(CASES) + sorted(AUTOTP_CASES))
    parser.add_argument("--keep-saves", action="store_true", help="reuse the stored checkpoints")
    args = parser.parse_args()
    python = ensure_venv(args.venv)
    manifest_path = DATA / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    manifest["deepspeed"] = DEEPSPEED_PIN
    manifest["world_size"] = WORLD_SIZE
    manifest["universal_world_size"] = UNIVERSAL_WORLD_SIZE
    manifest["universal_pipe_stages"] = UNIVERSAL_PIPE_STAGES
    manifest["universal_pipe_world_size"] = UNIVERSAL_PIPE_WORLD_SIZE
    cases = manifest.setdefault("cases", {})
    universal = manifest.setdefault("universal", {})
    autotp = manifest.setdefault("autotp", {})
    for case in args.cases:
        if case in AUTOTP_CASES:
            autotp[case] = make_autotp(python, case)
            print(case, autotp[case], flush=True)
            continue
        if not args.keep_saves:
            cases[case] = make_case(python, case)
        plain = not CASES[case].get("offload")  # an offload case writes its plain counterpart's files
        if plain and cases.get(case, {}).get("status") == "ok":
            universal[case] = make_universal(python, case)
        print(case, cases.get(case), universal.get(case), flush=True)
    DATA.mkdir(parents=True, exist_ok=True)
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
