"""What `testing.run_ranks`' forkserver imports before it forks any rank: torch and ds_comm, then frozen.

Importing this module has one effect beyond those imports, on purpose: `gc.freeze()` moves every object
alive at that point (torch's and ds_comm's modules, classes, functions: a few hundred thousand) into the
permanent generation. Each rank is a fork of this server, so without the freeze its every full
collection walked all of them again: about 0.3 s of CPU in a short engine run, over half of its garbage
collection time; with it, 0.07 s. Those objects live as long as the process anyway, so nothing that could
become garbage is kept, and forked pages that the collector no longer touches stay shared.
"""

from __future__ import annotations

import gc

import torch  # noqa: F401 - the point of the preload

import ds_comm  # noqa: F401 - the point of the preload

gc.collect()
gc.freeze()
