"""The Hugging Face `Trainer` with `deepspeed=ds_config.json` runs on ds (through the `deepspeed` distribution).

Each job: a tiny Llama built from a config and loaded with `from_pretrained` (under ZeRO-3 inside
`zero.Init`), 8 optimizer steps of 2 micro batches (gradient accumulation 2) on 2 gloo ranks, a ds_config
full of `"auto"` values with AdamW and WarmupDecayLR. The reference is the same Trainer job on plain
PyTorch DDP (torchrun) with torch's AdamW and DeepSpeed's WarmupDecayLR formula: fp32 losses agree
within 1e-5 at every step. Checkpoints every 4 steps; resuming from step 4 reproduces steps 5-8 exactly.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from launch_job import launch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

HERE = Path(__file__).parent
JOB = HERE / "hf_trainer_job.py"
TOL = 1e-5

BASE_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 1000,
    "fp16": {"enabled": "auto"},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
            "warmup_type": "linear",
        },
    },
}
ZERO2 = {
    "stage": 2,
    "overlap_comm": True,
    "contiguous_gradients": True,
    "reduce_bucket_size": "auto",
    "allgather_bucket_size": 5e8,
}
ZERO3 = {
    "stage": 3,
    "overlap_comm": True,
    "contiguous_gradients": True,
    "reduce_bucket_size": "auto",
    "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto",
    "stage3_gather_16bit_weights_on_model_save": True,
}


def _config(tmp: Path, name: str, zero: dict) -> Path:
    path = tmp / f"{name}.json"
    path.write_text(json.dumps({**BASE_CONFIG, "zero_optimization": zero}))
    return path


def _job(init: Path, out: Path, summary: Path, *extra: str) -> list[str]:
    return ["--init_dir", str(init), "--out_dir", str(out), "--summary", str(summary), *extra]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama saved with `save_pretrained` (built from a config, never downloaded)."""
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(HERE))
    from hf_trainer_job import tiny_config

    tmp = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config()).save_pretrained(tmp / "init")
    return tmp


@pytest.fixture(scope="module")
def ddp(work: Path) -> dict:
    """The reference: the same Trainer job on plain PyTorch DDP (no deepspeed), saving its final model."""
    summary = work / "ddp.json"
    launch(JOB, *_job(work / "init", work / "ddp_out", summary, "--save_model", str(work / "ddp_model")))
    return json.loads(summary.read_text())


def _assert_matches(run: dict, ref: dict) -> None:
    assert run["deepspeed"] and not ref["deepspeed"]
    assert sorted(run["losses"]) == sorted(ref["losses"]) == [str(i) for i in range(1, 9)]
    for step, loss in ref["losses"].items():
        assert abs(run["losses"][step] - loss) <= TOL, (step, run["losses"][step], loss)
    assert run["lrs"] == pytest.approx(ref["lrs"], rel=1e-12)
    assert run["checksum"] == pytest.approx(ref["checksum"], rel=1e-6)


@pytest.mark.timeout(900)
def test_zero2_matches_ddp_and_resumes_exactly(work: Path, ddp: dict) -> None:
    cfg, out = _config(work, "zero2", ZERO2), work / "z2_out"
    first, resumed = work / "z2.json", work / "z2_resumed.json"
    # through ds's `deepspeed` launcher, as `deepspeed train.py --deepspeed ds_config.json` runs
    launch(JOB, *_job(work / "init", out, first, "--save_steps", "4"), "--ds_config", str(cfg), launcher="deepspeed")
    a = json.loads(first.read_text())
    _assert_matches(a, ddp)
    assert a["cpu_offload"] is False
    assert (out / "checkpoint-4" / "global_step4").is_dir() and (out / "checkpoint-4" / "latest").is_file()

    launch(
        JOB,
        *_job(work / "init", work / "z2_resumed_out", resumed, "--resume", str(out / "checkpoint-4")),
        "--ds_config",
        str(cfg),
        launcher="deepspeed",
    )
    b = json.loads(resumed.read_text())
    assert b["global_step"] == 8
    assert {k: b["losses"][k] for k in "5678"} == {k: a["losses"][k] for k in "5678"}  # bit-exact
    assert b["checksum"] == a["checksum"] and b["lrs"] == a["lrs"]


@pytest.mark.timeout(600)
def test_zero2_cpu_optimizer_offload_matches_ddp(work: Path, ddp: dict) -> None:
    cfg = _config(work, "zero2_offload", {**ZERO2, "offload_optimizer": {"device": "cpu"}})
    summary = work / "z2o.json"
    launch(JOB, *_job(work / "init", work / "z2o_out", summary), "--ds_config", str(cfg))
    run = json.loads(summary.read_text())
    _assert_matches(run, ddp)
    assert run["cpu_offload"] is True and run["basic_optimizer"] == "DeepSpeedCPUAdam"


@pytest.mark.timeout(900)
def test_zero3_from_pretrained_matches_ddp_resumes_and_saves_full_model(work: Path, ddp: dict) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    cfg, out = _config(work, "zero3", ZERO3), work / "z3_out"
    first, resumed = work / "z3.json", work / "z3_resumed.json"
    launch(
        JOB,
        *_job(work / "init", out, first, "--save_steps", "4", "--save_model", str(work / "z3_model")),
        "--ds_config",
        str(cfg),
    )
    a = json.loads(first.read_text())
    assert a["partitioned_at_load"]  # from_pretrained built the model inside zero.Init
    _assert_matches(a, ddp)

    launch(
        JOB,
        *_job(work / "init", work / "z3_resumed_out", resumed, "--resume", str(out / "checkpoint-4")),
        "--ds_config",
        str(cfg),
    )
    b = json.loads(resumed.read_text())
    assert {k: b["losses"][k] for k in "5678"} == {k: a["losses"][k] for k in "5678"}
    assert b["checksum"] == a["checksum"]

    # save_model at ZeRO-3 gathered the full weights into one model.safetensors: a plain model again.
    assert (work / "z3_model" / "model.safetensors").is_file()
    saved = AutoModelForCausalLM.from_pretrained(work / "z3_model", dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(work / "ddp_model", dtype=torch.float32).eval()
    ids = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert torch.allclose(saved(ids).logits, reference(ids).logits, atol=TOL, rtol=0)
