"""`ds-engine explain CONFIG [--world-size N]`: why did my setting (not) take effect?

Prints the resolved batch triple with where each number came from, the wrapper chain
`initialize()` would build (base optimizer -> wrapper -> engine), unfilled "auto" placeholders,
and every config value marked as set by you or defaulted. Nothing is built; no process group,
device or model is touched. Also runnable as `python -m ds_engine.explain CONFIG`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from pydantic import BaseModel
from torch import nn

from ds_comm import get_accelerator
from ds_engine._data.describe import describe_data_sampling
from ds_engine._data.describe_routing import data_efficiency_lines
from ds_engine._parallel.autoep import describe_autoep
from ds_engine._plan.compile_schedule import default_schedule, describe_steps
from ds_engine._plan.plan import plan_assembly
from ds_engine.config import DeepSpeedConfig, DeepSpeedConfigError
from ds_engine.config._compile_section import describe_deepcompile

__all__ = ["cli", "explain", "main"]

_PIPE_SECTIONS = ("pipeline", "activation_checkpointing")


def _flatten(value: Any, prefix: str, aliases: dict[str, str]) -> Iterator[tuple[str, Any]]:
    if isinstance(value, BaseModel):
        for old, new in getattr(type(value), "deprecated_keys", {}).items():  # `aio.thread_count` sets intra_op_...
            aliases.setdefault(f"{prefix}.{new}" if prefix else new, f"{prefix}.{old}" if prefix else old)
        for name, field in type(value).model_fields.items():
            path = f"{prefix}.{name}" if prefix else name
            if field.alias and field.alias != name:
                aliases[path] = f"{prefix}.{field.alias}" if prefix else field.alias
            yield from _flatten(getattr(value, name), path, aliases)
    elif isinstance(value, dict) and value:
        for key, item in value.items():
            yield from _flatten(item, f"{prefix}.{key}", aliases)
    else:
        yield prefix, value


def _resolved_rows(config: DeepSpeedConfig) -> list[tuple[str, Any, str]]:
    given = {p.replace("bfloat16.", "bf16.", 1) if p.startswith("bfloat16.") else p for p in config.iter_given_paths()}
    aliases: dict[str, str] = {}
    rows = []
    for path, value in _flatten(config.parsed, "", aliases):
        if path.startswith(("zero_optimization", *_PIPE_SECTIONS)):
            continue
        rows.append((path, value, "set" if path in given or aliases.get(path) in given else "default"))
    for name in _PIPE_SECTIONS:
        try:
            section = getattr(config, name)  # ds-pipe's model (its defaults when the section is absent)
        except DeepSpeedConfigError:
            continue  # absent, and ds-pipe is not installed to say what its defaults are
        for path, value in _flatten(section, name, aliases):
            rows.append((path, value, "set" if path in given or aliases.get(path) in given else "default"))
    zero = config.zero.zero_config
    if zero is not None:
        for path, value in _flatten(zero, "zero_optimization", aliases):
            rows.append((path, value, "set" if path in given or aliases.get(path) in given else "default"))
    else:
        rows.append(
            ("zero_optimization.stage", config.zero.stage, "set" if "zero_optimization.stage" in given else "default")
        )
    if config.batch is not None:
        b = config.batch
        lookup = {
            "train_batch_size": b.train_batch_size,
            "train_micro_batch_size_per_gpu": b.train_micro_batch_size_per_gpu,
            "gradient_accumulation_steps": b.gradient_accumulation_steps,
        }
        rows = [(p, lookup.get(p, v), "derived" if p in lookup and b.sources[p] != "given" else s) for p, v, s in rows]
    return rows


def explain(config: DeepSpeedConfig, *, device_type: str | None = None, model: nn.Module | None = None) -> str:
    """The explanation text for an already-validated config.

    `model` (optional) is looked at, never changed: with `expert_parallel.enabled`, the MoE blocks AutoEP
    would replace in it are listed with where each expert would live.
    """
    lines = [
        f"config: {config.source}",
        f"data-parallel world size: {config.world_size} ({config.world_size_source})",
        "",
        "batch",
    ]
    if config.batch is None:
        lines.append('  unresolved: the batch keys hold "auto" placeholders')
    else:
        for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
            lines.append(f"  {key:<32}{getattr(config.batch, key):>8}   {config.batch.sources[key]}")
    plan = plan_assembly(config, device_type=device_type or get_accelerator().name)
    lines += ["", "wrapper chain initialize() would build", *(f"  {line}" for line in plan.lines())]
    if config.parsed.autotuning.enabled:
        lines += [
            "",
            "autotuning experiment (autotuning.enabled)",
            *(f"  {line}" for line in config.parsed.autotuning.describe()),
        ]
    if config.parsed.expert_parallel.enabled:
        lines += [
            "",
            "expert parallelism (AutoEP: expert_parallel.enabled)",
            *(
                f"  {line}"
                for line in describe_autoep(config.parsed.expert_parallel, world_size=config.world_size, model=model)
            ),
        ]
    dc_lines = describe_deepcompile(config.parsed.compile, config.zero.stage)
    if dc_lines:
        steps = describe_steps(default_schedule(config.zero.stage)) if config.zero.stage else "none (stage 0)"
        dc_lines.append(f"pass schedule unless engine.compile(schedule=...) gives one: {steps}")
        lines += ["", "DeepCompile (compile.deepcompile)", *(f"  {line}" for line in dc_lines)]
    data_lines = describe_data_sampling(config.data_efficiency_config)
    if data_lines:
        lines += ["", "data sampling", *(f"  {line}" for line in data_lines)]
    batch = config.batch.train_batch_size if config.batch is not None else None
    lines += [
        "",
        "data efficiency",
        *(f"  {line}" for line in data_efficiency_lines(config.parsed.data_efficiency, train_batch_size=batch)),
    ]
    if "use_data_before_expert_parallelism" in config.raw:
        lines += ["", "mixture of experts (MoE layers)", f"  {_moe_layout_line(config)}"]
    if config.auto_keys:
        lines += [
            "",
            'unfilled "auto" placeholders (initialize() refuses them; fill with auto_values= / --auto):',
            *(f"  {key}" for key in config.auto_keys),
        ]
    rows = _resolved_rows(config)
    width = max(len(p) for p, _, _ in rows)
    lines += ["", "resolved config (set = in your file, default = applied by ds, derived = computed)"]
    lines += [f"  {path:<{width}}  {value!r:<24} {source}" for path, value, source in rows]
    return "\n".join(lines)


def _moe_layout_line(config: DeepSpeedConfig) -> str:
    if config.parsed.use_data_before_expert_parallelism:
        return (
            "expert groups data-before-expert (use_data_before_expert_parallelism=true): expert-data-parallel "
            "groups are consecutive ranks, expert-parallel groups stride over them"
        )
    return "expert groups expert-before-data (the default): expert-parallel groups are consecutive ranks"


def _parse_auto(pairs: Sequence[str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep:
            raise SystemExit(f"--auto expects KEY=VALUE, got {pair!r}")
        try:
            values[key] = json.loads(text)
        except json.JSONDecodeError:
            values[key] = text
    return values


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("config", help="ds_config: a JSON/hjson file, or base64-encoded JSON")
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="data-parallel world size to resolve the batch triple for (default 1)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help="device type to plan for (default: this machine's accelerator)",
    )
    parser.add_argument(
        "--auto",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help='fill an "auto" placeholder, e.g. --auto train_micro_batch_size_per_gpu=8 (repeatable)',
    )
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "python -m ds_engine.explain") -> int:
    """Run `explain` with command-line arguments; returns the exit code (2 for a config error)."""
    args = _parser(prog).parse_args(argv)
    try:
        config = DeepSpeedConfig(args.config, world_size=args.world_size or 1, auto_values=_parse_auto(args.auto))
        text = explain(config, device_type=args.device)
    except (DeepSpeedConfigError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(text)
    return 0


def cli(argv: Sequence[str] | None = None) -> int:
    """The `ds-engine` console script: `ds-engine explain CONFIG ...`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: ds-engine explain CONFIG [--world-size N] [--device cpu|cuda] [--auto KEY=VALUE]\n\n"
            "commands:\n  explain   show the resolved config and the wrapper chain initialize() would build"
        )
        return 0 if argv else 2
    if argv[0] != "explain":
        print(f"ds-engine: unknown command {argv[0]!r}; the command is 'explain'", file=sys.stderr)
        return 2
    return main(argv[1:], prog="ds-engine explain")


if __name__ == "__main__":
    sys.exit(main())
