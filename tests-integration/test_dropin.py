"""DeepSpeed drop-in: a script written against DeepSpeed's documented API runs after `import ds_engine as deepspeed`.

`dropin/train_deepspeed_style.py` is a DeepSpeed tutorial-style script; the configs are DeepSpeed tutorial
configs (ZeRO-2 with CPU offload and fp16 dynamic loss scaling; fp16 with WarmupLR, clipping, wall-clock
breakdown and gradient accumulation), accepted as is. Each runs on 2 ranks through the launcher for 8 micro
batches, saving after micro batch 4; a second launch loads that checkpoint and must reproduce micro batches
5-8 exactly (same losses, same final parameters) and return the client_state it saved.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import deepspeed

HERE = Path(__file__).parent / "dropin"


@pytest.mark.timeout(400)
@pytest.mark.parametrize("config", ["ds_config_zero2_offload.json", "ds_config_fp16_warmup.json"])
def test_deepspeed_script_runs_and_resumes_unchanged(tmp_path: Path, config: str) -> None:
    script, cfg, save = HERE / "train_deepspeed_style.py", str(HERE / config), str(tmp_path / "ckpt")
    first, resumed = tmp_path / "first.json", tmp_path / "resumed.json"
    deepspeed(2, script, "--deepspeed", "--deepspeed_config", cfg, "--save_dir", save, "--out", str(first))
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step2"  # 4 micro batches, accumulation 2
    deepspeed(
        2,
        script,
        "--deepspeed",
        "--deepspeed_config",
        cfg,
        "--save_dir",
        save,
        "--out",
        str(resumed),
        "--resume_tag",
        "global_step2",
    )
    a, b = json.loads(first.read_text()), json.loads(resumed.read_text())

    assert a["module_type"] == "Net" and a["local_rank"] == 0 and a["world_size"] == 2 and a["fp16"]
    assert a["zero_stage"] == json.loads(Path(cfg).read_text())["zero_optimization"]["stage"]
    assert a["global_steps"] == 4 and a["client_state"] is None
    assert all(math.isfinite(v) for v in a["losses"].values())
    # client_state comes back intact, beside the engine's own leftover keys (as DeepSpeed returns them)
    state = b["client_state"]
    assert state["step"] == 4 and state["note"] == "resume here"
    assert state["losses"] == {k: v for k, v in a["losses"].items() if int(k) <= 4}
    # the resumed run continues exactly where the first one went on
    assert b["global_steps"] == 4
    assert b["losses"] == {k: v for k, v in a["losses"].items() if int(k) > 4}
    assert b["param_sum"] == a["param_sum"] and b["lr"] == a["lr"]
