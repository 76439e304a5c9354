"""One DeepSpeedExamples program as tools/deepspeed_examples.py runs it: where it lives, how it is made small, how
it is launched, and how its losses are read from its output.

A program is exported from a DeepSpeedExamples checkout into a scratch folder and edited there (synthetic data
instead of downloads, a tiny config-built model instead of a pretrained one): nothing of DeepSpeedExamples is
committed here, only the recipe of edits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

#: Placeholders an argv may hold; the runner substitutes the side's interpreter and launcher.
PYTHON = "{python}"
LAUNCHER = "{deepspeed}"


@dataclass(frozen=True, kw_only=True)
class Program:
    """A DeepSpeedExamples program, made runnable on a CPU host with the smallest edits.

    Attributes:
        name: Short unique id, e.g. ``"cifar10-zero3"``; one program may appear under several names with
            other configs.
        source: The folder inside DeepSpeedExamples it comes from, e.g. ``"training/cifar"``.
        prepare: ``prepare(source_dir, work_dir)`` edits the exported copy in ``work_dir`` (which already holds
            ``source_dir``'s files; ``source_dir`` is the unedited export, to read only) so it runs offline and
            small; it returns the directory to run in (``work_dir`` or a folder inside it).
        argv: The command, run in the directory ``prepare`` returned; ``{python}`` and ``{deepspeed}`` are
            replaced by the side's interpreter and ``deepspeed`` launcher (the launcher followed by a free
            ``--master_port``), also inside a longer string such as a ``bash -c`` line.
        setup: Commands run before ``argv`` in the same directory with the same substitutions, e.g. building a
            tiny model with ``{python} ds_offline.py llama tiny-llama``; a failing one fails the run.
        loss_pattern: A regex with one group that captures one logged training loss per match, in order.
        deterministic: Whether ds and DeepSpeed must print the same losses (same seeds, no data-order or
            kernel nondeterminism in the program).
        env: Extra environment for the run.
        timeout_s: Wall-clock limit for one side's run.
        requirements: Pure-Python packages the program imports that neither side's venv has (``fire``,
            ``loguru``...): installed without dependencies into one folder on both sides' ``PYTHONPATH``.
        notes: Why the run differs from the upstream command (fewer ranks, a removed assert...), for the table.
    """

    name: str
    source: str
    prepare: Callable[[Path, Path], Path]
    argv: tuple[str, ...]
    loss_pattern: str
    deterministic: bool = True
    env: Mapping[str, str] = field(default_factory=dict)
    timeout_s: int = 900
    setup: tuple[tuple[str, ...], ...] = ()
    requirements: tuple[str, ...] = ()
    notes: str = ""
