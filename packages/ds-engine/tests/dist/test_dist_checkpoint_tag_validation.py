"""`checkpoint.tag_validation` on 2 gloo ranks: ranks that pass different tags to `save_checkpoint`.

FAIL raises before anything is written (a ValueError that is also the AssertionError DeepSpeed raises
there); WARN logs and saves each rank's files under its own tag; IGNORE does not compare the tags.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from ds_engine_testkit import base_config, make_engine, tiny_net

from ds_comm.testing import run_ranks


def _save_with_rank_tags(rank: int, world: int, root: str, mode: str) -> dict[str, Any]:
    engine = make_engine(tiny_net(), base_config(checkpoint={"tag_validation": mode}))
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("ds_engine").addHandler(handler)
    try:
        engine.save_checkpoint(root, tag=f"tag-{rank}")
        raised = None
    except ValueError as err:
        raised = (type(err).__name__, isinstance(err, AssertionError), str(err))
    finally:
        logging.getLogger("ds_engine").removeHandler(handler)
    return {
        "raised": raised,
        "warned": any("differs across ranks" in m for m in records),
        "own_tag_saved": (Path(root) / f"tag-{rank}").is_dir(),
    }


@pytest.mark.parametrize("mode", ["FAIL", "WARN", "IGNORE"])
def test_different_tags_per_rank(mode: str, tmp_path: Path) -> None:
    results = run_ranks(2, _save_with_rank_tags, root=str(tmp_path), mode=mode, timeout_s=120)
    for result in results:
        if mode == "FAIL":
            name, is_assertion, message = result["raised"]
            assert name == "CheckpointTagMismatchError" and is_assertion
            assert "differs across ranks" in message and "tag_validation=FAIL" in message
            assert not result["own_tag_saved"]
        else:
            assert result["raised"] is None and result["own_tag_saved"]
            assert result["warned"] == (mode == "WARN")
    if mode == "FAIL":
        assert list(tmp_path.iterdir()) == []
