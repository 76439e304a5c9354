"""`deepspeed.nvme.torch_io` / `torch_fastio_engine`: DeepSpeed's engine names over ds-ops' engines, whose
context keys are `ds_aio_constants`' (a script indexing `engine.ctxt[FILE]` finds the file)."""

from __future__ import annotations

import types
from pathlib import Path

import torch

from ds_ops.nvme import ds_aio_constants as c
from ds_ops.nvme.torch_fastio_engine import Torch_FastIO_Engine
from ds_ops.nvme.torch_io import TorchIO_Engine


def test_engines_fill_deepspeeds_context_keys(tmp_path: Path) -> None:
    args = types.SimpleNamespace(
        mapping_list=[(0, str(tmp_path))],
        io_size=8192,
        gpu=False,
        block_size=4096,
        queue_depth=2,
        single_submit=False,
        sequential_requests=False,
        io_parallel=1,
        fast_io_size=8192,
        torch_legacy_save=False,
    )
    for cls in (TorchIO_Engine, Torch_FastIO_Engine):
        engine = cls(args, 0, False)
        seconds = engine.write(args, 0)
        assert engine.ctxt[c.ELAPSED_SEC] == seconds and engine.ctxt[c.NUM_BYTES] == 8192
        loaded = torch.load(engine.ctxt[c.FILE], weights_only=True)
        assert torch.equal(loaded, engine.ctxt[c.BUFFER]) and c.TORCH_IO in c.VALID_ENGINES
        engine.fini()
        assert engine.ctxt[c.BUFFER] is None
