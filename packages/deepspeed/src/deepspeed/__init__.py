"""`import deepspeed` for code written against DeepSpeed 0.19.8: ds-engine's API under DeepSpeed's name.

Every name is ds-engine's own object (`deepspeed.initialize is ds_engine.initialize`,
`deepspeed.DeepSpeedEngine is ds_engine.DeepSpeedEngine`), and every DeepSpeed module path resolves to
the ds module that implements it (`deepspeed.runtime.zero.partition_parameters`,
`deepspeed.checkpoint.utils`, `deepspeed.ops.adam`, `deepspeed.launcher.runner`...; see `_aliases`).
Only `__version__` is this distribution's: the DeepSpeed API level, which the frameworks' version
checks read; `ds_engine.__version__` stays ds-engine's own. Importing it also sets one ds-engine default:
checkpoints are saved in DeepSpeed's layout unless the config's `checkpoint.layout` says otherwise.
"""

from __future__ import annotations

import ds_engine as _ds_engine
from deepspeed import __about__, _aliases
from ds_engine import *  # noqa: F403 - the whole public API, as the same objects
from ds_engine.config import set_default_checkpoint_layout as _set_default_checkpoint_layout

_aliases.install()
# DeepSpeed's users bring tools that read DeepSpeed's checkpoint files (its zero_to_fp32.py, the frameworks'
# helpers): engines initialized from here on save in DeepSpeed's layout unless `checkpoint.layout` says
# otherwise (ds-engine's setting; it falls back to ds's layout, logged, where DeepSpeed's cannot hold the job).
_set_default_checkpoint_layout("deepspeed")

# After the star import, which brought ds-engine's own `__version__`/`version`.
__version__ = version = __about__.__version__
__version_major__, __version_minor__, __version_patch__ = (
    int(part) for part in __version__.split("+")[0].split(".")[:3]
)

__all__ = [*(name for name in _ds_engine.__all__ if name not in ("__version__", "version")), "__version__", "version"]


def __getattr__(name: str) -> object:
    # ds-engine's lazily served names (`zero`, `pipe`, `runtime`, `DeepSpeedConfig`...), as the same objects.
    try:
        return getattr(_ds_engine, name)
    except AttributeError:
        raise AttributeError(f"module 'deepspeed' has no attribute {name!r} (ds_engine does not provide it)") from None


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(dir(_ds_engine)))
