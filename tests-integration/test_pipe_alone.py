"""examples/pipe_alone.py: ds-pipe with no engine trains the GPT as a 2-stage pipeline through the launcher."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import deepspeed

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "pipe_alone.py"


def test_pipe_alone_trains_two_stages() -> None:
    out = deepspeed(2, EXAMPLE, "--steps", "10").stdout
    losses = [float(x) for x in re.findall(r"step +\d+ \| loss ([0-9.]+)", out)]
    assert len(losses) == 3, out
    assert losses[-1] < losses[0] - 0.5, f"loss should fall visibly: {losses}"
