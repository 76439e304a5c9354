"""`checkpoint.writer.data_parallel: replica` on 2 gloo ranks: both ranks write stripes of one model-states file.

The file both ranks wrote holds the trained state (a fresh pair of engines loads it to the same weights and
optimizer state), each rank wrote part of it and together all of it; a save whose ranks serialize different bytes
(a `client_state` that differs per rank) is refused on every rank and leaves `latest` and the last tag as they were.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import torch
from ds_engine_testkit import base_config, batches, flat_params, loss_fn, make_engine, tiny_net

from ds_comm.testing import run_ranks

CONFIG = base_config(
    checkpoint={"writer": {"io_buffer_size": 8192, "data_parallel": "replica", "show_statistics": True}}
)


def _replica_save(rank: int, world: int, root: str) -> dict[str, Any]:
    model = tiny_net(0)
    engine = make_engine(model, CONFIG)
    for x, y in batches(2, 4, seed=1 + rank):
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("ds_engine._checkpoint.file_writer")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    engine.save_checkpoint(root, tag="a", client_state={"same": 1})
    moved = [int(m) for r in records for m in re.findall(r"'aio_bytes': (\d+)", r)]
    refused = None
    try:
        engine.save_checkpoint(root, tag="a", client_state={"rank": rank})
    except ValueError as err:
        refused = (type(err).__name__, str(err))
    fresh_model = tiny_net(5)
    fresh = make_engine(fresh_model, CONFIG)
    _, client = fresh.load_checkpoint(root)
    a, b = engine.optimizer.state_dict()["state"], fresh.optimizer.state_dict()["state"]
    return {
        "moved": moved,
        "refused": refused,
        "client": client["same"],
        "weights_equal": torch.equal(flat_params(fresh_model), flat_params(model)),
        "optimizer_equal": all(torch.equal(a[i][k], b[i][k]) for i in a for k in ("exp_avg", "exp_avg_sq")),
    }


def test_replica_ranks_write_one_model_states_file(tmp_path: Path) -> None:
    results = run_ranks(2, _replica_save, root=str(tmp_path), timeout_s=180)
    size = (tmp_path / "a" / "mp_rank_00_model_states.pt").stat().st_size
    shares = [r["moved"] for r in results]
    assert all(len(s) == 1 and 0 < s[0] < size for s in shares), (shares, size)
    assert shares[0][0] + shares[1][0] == size
    for r in results:
        assert r["refused"] is not None and r["refused"][0] == "ReplicaWriteError"
        assert "serialized different bytes" in r["refused"][1] or "another data-parallel rank" in r["refused"][1]
        assert r["client"] == 1 and r["weights_equal"] and r["optimizer_equal"]
    assert (tmp_path / "latest").read_text() == "a"
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["mp_rank_00_model_states.pt"]
