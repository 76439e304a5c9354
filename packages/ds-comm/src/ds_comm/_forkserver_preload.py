"""What `testing.run_ranks`' forkserver imports before it forks any rank: torch, ds_comm and the modules
a test suite named with `testing.preload_in_ranks`, then frozen.

Importing this module has one effect beyond those imports, on purpose: `gc.freeze()` moves every object
alive at that point (torch's and ds_comm's modules, classes, functions: a few hundred thousand) into the
permanent generation. Each rank is a fork of this server, so without the freeze its every full
collection walked all of them again: about 0.3 s of CPU in a short engine run, over half of its garbage
collection time; with it, 0.07 s. Those objects live as long as the process anyway, so nothing that could
become garbage is kept, and forked pages that the collector no longer touches stay shared.

[Note: preloading a suite's modules] Every rank imports the test module that holds its function, and
with it the stack under test: the engine and ZeRO (about 0.6 s of CPU) and, for the Hugging Face cases,
transformers' model code (3-4 s). Each rank of each test paid that again. A suite names those modules once
(`preload_in_ranks`, which passes them here through `PRELOAD_ENV`); the server imports them before it
forks, so every rank starts with them in `sys.modules`. A module that is not installed, or that fails
to import, is skipped: the rank imports it itself and reports the error where the test can show it.
"""

from __future__ import annotations

import gc
import importlib
import os

import torch  # noqa: F401 - the point of the preload

import ds_comm  # noqa: F401 - the point of the preload

PRELOAD_ENV = "DS_TESTING_PRELOAD"

for _name in filter(None, os.environ.get(PRELOAD_ENV, "").split(",")):
    try:
        importlib.import_module(_name)
    except Exception:  # noqa: BLE001 - optional: a rank that needs it imports it and fails visibly there
        pass

gc.collect()
gc.freeze()
