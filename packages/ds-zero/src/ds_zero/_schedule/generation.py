"""`unwrap_model_for_generation`: a ZeRO-3 model gathered whole, without its hooks, for token-by-token generation.

Generation runs the model once per new token; under stage 3 each of those forwards would gather and
release every module's parameters again. DeepSpeed's context manager (which RLHF libraries call around
`model.generate`) gathers all parameters once and takes the gather/release hooks off for the block, so
generation costs one gather and runs at plain-module speed, at the memory cost of the whole model on
every rank. The hooks come back and the parameters are released on exit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from ds_zero._params.gathered_parameters import GatheredParameters

__all__ = ["unwrap_model_for_generation"]


@contextlib.contextmanager
def unwrap_model_for_generation(model: Any) -> Iterator[Any]:
    """Yield `model` (an engine with `.module`, or the model itself) with every parameter gathered and no hooks.

    A model without stage-3 management (ZeRO 0-2) is yielded as it is. A collective on entry and exit
    (the gather, and the release bookkeeping): every data-parallel rank enters the block.
    """
    module = getattr(model, "module", model)
    offload = getattr(module, "_ds_zero3", None)
    if offload is None:
        yield model
        return
    with GatheredParameters(list(module.parameters())), offload.hooks_paused():
        yield model
