"""kill -9 at every file-system step of a checkpoint save leaves the previous checkpoint loadable and `latest` on it.

One kind per test: engine ZeRO-0 (1 rank), ZeRO-1, ZeRO-2, ZeRO-3, a 2-stage pipeline and ZeRO-2 with
`checkpoint.layout: "deepspeed"` (2 gloo ranks). `checkpoint_kill_driver.py` (its docstring has the
method) saves checkpoint 2 over a directory holding checkpoint 1 and SIGKILLs rank r at its n-th step
(open, write, fsync, replace, fsync_dir of every file it writes), for every r and every n whose kill
leaves its own state on disk (a kill before an fsync leaves what a kill before the next step does); after each kill a
fresh group loads `latest` and must get checkpoint 1's exact state, or checkpoint 2's exact state where
`latest` already moved.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

DRIVER = Path(__file__).with_name("checkpoint_kill_driver.py")
EVENTS = ("open", "write", "fsync", "replace", "fsync_dir")
_ZERO_FILES = [
    [
        "global_step2/mp_rank_00_model_states.pt",
        "global_step2/zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "ckpt/latest",
    ],
    ["global_step2/zero_pp_rank_1_mp_rank_00_optim_states.pt"],
]
#: kind -> (the sibling it needs, the files each rank writes in one save, in order)
KINDS: dict[str, tuple[str | None, list[list[str]]]] = {
    "zero0": (None, [["global_step2/mp_rank_00_model_states.pt", "ckpt/latest"]]),
    "zero2": ("ds_zero", _ZERO_FILES),
    "zero3": ("ds_zero", _ZERO_FILES),
    "pipeline": (
        "ds_pipe",
        [
            [
                "global_step2/layer_00-model_states.pt",
                "global_step2/layer_01-model_states.pt",
                "global_step2/mp_rank_00_model_states.pt",
                "ckpt/latest",
            ],
            [
                "global_step2/layer_02-model_states.pt",
                "global_step2/layer_03-model_states.pt",
                "global_step2/mp_rank_01_model_states.pt",
            ],
        ],
    ),
    # checkpoint.layout "deepspeed": the staged ds save, then each rank's DeepSpeed files (zero_to_fp32.py is
    # already there, identical, so not rewritten); the tag directory's rename is no file event, `latest` follows it.
    "zero2_deepspeed": (
        "ds_zero",
        [
            [
                "ds-layout/mp_rank_00_model_states.pt",
                "ds-layout/zero_pp_rank_0_mp_rank_00_optim_states.pt",
                "deepspeed-layout/mp_rank_00_model_states.pt",
                "deepspeed-layout/zero_pp_rank_0_mp_rank_00_optim_states.pt",
                "ckpt/latest",
            ],
            [
                "ds-layout/zero_pp_rank_1_mp_rank_00_optim_states.pt",
                "deepspeed-layout/zero_pp_rank_1_mp_rank_00_optim_states.pt",
            ],
        ],
    ),
}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_save_killed_at_any_step_leaves_a_loadable_latest(kind: str, tmp_path: Path) -> None:
    needs, files = KINDS[kind]
    if needs is not None:
        pytest.importorskip(needs, reason=f"{kind} checkpoints need {needs.replace('_', '-')}")
    proc = subprocess.run(
        [sys.executable, str(DRIVER), kind, str(tmp_path)], capture_output=True, text=True, timeout=380, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["distinct"], "checkpoints 1 and 2 must differ, or a stale load would go unnoticed"
    points = report["points"]
    for rank, names in enumerate(files):
        # Every step of every file, in order, on every rank, as the reference save made them ...
        expected = [f"{event} {name}" for name in names for event in EVENTS]
        assert report["events"][rank] == expected, report["events"][rank]
        # ... and a kill at each one whose state on disk differs (under SIGKILL an fsync changes nothing a
        # reader sees, so a kill before one equals a kill before the next step; see the driver).
        hit = [p["event"] for p in points if p["rank"] == rank]
        assert hit == [e for i, e in enumerate(expected) if not e.startswith("fsync") or i == len(expected) - 1], hit
    for point in points:
        where = f"rank {point['rank']} killed before {point['event']}"
        assert point["killed"], f"{where}: the rank did not die of SIGKILL there"
        assert point["latest"] in ("global_step1", "global_step2"), where
        assert point["loaded_tag"] == [point["latest"]] * report["world"], where
        assert point["matches"], f"{where}: loading latest={point['latest']} did not restore that checkpoint exactly"
    # `latest` moves only with its own rename, the very last step of the save; before it, checkpoint 1 stays.
    moved = [(p["rank"], p["event"]) for p in points if p["latest"] == "global_step2"]
    assert moved == [(0, "fsync_dir ckpt/latest")], moved
