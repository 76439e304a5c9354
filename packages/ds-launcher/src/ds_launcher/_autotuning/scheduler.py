"""Running experiments: each one is the user's script launched by ds's own launcher with its own ds_config.

Experiments run one at a time on the resources the tuning command was given (its `--hostfile`,
`--include`/`--exclude`, `--num_nodes`, `--num_gpus` and other launcher flags are passed on), each with
`--master_port` moved by the experiment's number so a port still held by the previous job is not
reused. The autotuner and the experiments share nothing but files:

    <exps_dir>/<name>.json              what to run (DeepSpeed's experiment description)
    <results_dir>/<name>/ds_config.json the experiment's config (autotuning on, metric_path below)
    <results_dir>/<name>/exp.json       the description plus its command, port and result
    <results_dir>/<name>/cmd.txt        the command line
    <results_dir>/<name>/stdout.log, stderr.log
    <results_dir>/<name>/metrics.json   written by the engine's rank 0 after the profiled steps

An experiment succeeded when the launcher exited with status 0 and the metrics file exists; otherwise
the error is the exit status and the last line of its stderr that mentions an error.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ds_launcher._args import build_parser
from ds_launcher._autotuning.settings import UserConfig

logger = logging.getLogger(__name__)

__all__ = ["ExperimentResult", "ExperimentScheduler", "get_val_by_key", "launcher_flags", "set_val_by_key"]

#: Launcher flags the autotuner sets per experiment (or that make no sense for one).
_NOT_FORWARDED = frozenset({"help", "autotuning", "master_port", "user_script", "user_args", "save_pid"})


def get_val_by_key(d: dict[str, Any], key: str) -> Any:
    """The value of `key` in `d` or the first nested dict holding it, depth first (None: absent)."""
    if key in d:
        return d[key]
    for value in d.values():
        if isinstance(value, dict):
            found = get_val_by_key(value, key)
            if found is not None:
                return found
    return None


def set_val_by_key(d: dict[str, Any], key: str, value: Any) -> None:
    """Set `key` to `value` wherever it occurs in `d` and its nested dicts."""
    if key in d:
        d[key] = value
    for nested in d.values():
        if isinstance(nested, dict):
            set_val_by_key(nested, key, value)


def launcher_flags(args: argparse.Namespace | None) -> list[str]:
    """The tuning command's launcher flags that differ from their defaults, to repeat for each experiment."""
    if args is None:
        return []
    flags: list[str] = []
    for action in build_parser()._actions:
        if action.dest in _NOT_FORWARDED or not action.option_strings:
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default or value is None:
            continue
        option = next((o for o in action.option_strings if o.startswith("--")), action.option_strings[0])
        if isinstance(action, argparse._StoreTrueAction):
            flags.append(option)
        else:
            flags += [option, str(value)]
    return flags


@dataclass(frozen=True)
class ExperimentResult:
    """What one experiment left behind."""

    name: str
    result_dir: Path
    metrics: dict[str, Any] | None
    error: str | None
    duration_s: float
    command: list[str]


def _last_error_line(stderr: Path) -> str:
    try:
        lines = stderr.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        if "error" in line.lower():
            return line.strip()
    return lines[-1].strip() if lines else ""


def _write_json(path: Path, payload: Any) -> None:
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")


class ExperimentScheduler:
    """Launches the experiments of a tuning job, one at a time, and collects their metrics.

    Args (DeepSpeed's `ResourceManager` signature first):
        args: the parsed `deepspeed` command (`user_script`, `user_args`, launcher flags); None in tests
            that only read the mappings.
        hosts: the hosts of the job (a list, or a comma-separated string).
        num_gpus_per_node: ranks per host.
        results_dir: where each experiment's folder goes.
        exps_dir: where the experiment descriptions go.
        arg_mappings: ds_config key -> the script's argument that carries its value.
        user_config: the script's ds_config and its place among the script's arguments.
        overwrite: False: an experiment whose metrics already exist is read back instead of rerun.
        python: the interpreter that runs the launcher.
    """

    def __init__(
        self,
        args: argparse.Namespace | None,
        hosts: Sequence[str] | str,
        num_gpus_per_node: int,
        results_dir: str | os.PathLike[str] | None,
        exps_dir: str | os.PathLike[str] | None,
        arg_mappings: dict[str, str] | None,
        *,
        user_config: UserConfig | None = None,
        overwrite: bool = True,
        python: str = sys.executable,
    ) -> None:
        self.args = args
        self.nodes = [h.strip() for h in hosts.split(",")] if isinstance(hosts, str) else list(hosts)
        self.num_gpus_per_node = num_gpus_per_node
        self.results_dir = Path(results_dir) if results_dir is not None else None
        self.exps_dir = Path(exps_dir) if exps_dir is not None else None
        self.arg_mappings = {k.strip(): v.strip() for k, v in (arg_mappings or {}).items()}
        self.user_config = user_config
        self.overwrite = overwrite
        self.python = python
        self.experiment_count = 0

    def script_args(self, ds_config: dict[str, Any], config_path: Path) -> list[str]:
        """The script's arguments for an experiment: its config path, and each `arg_mappings` value."""
        assert self.args is not None and self.user_config is not None
        args = self.user_config.args_with(self.args.user_args, config_path)
        for key, flag in self.arg_mappings.items():
            value = get_val_by_key(ds_config, key)
            if value is None or value == "auto":
                continue
            if flag in args and args.index(flag) + 1 < len(args):
                args[args.index(flag) + 1] = str(value)
            else:
                args += [flag, str(value)]
        return args

    def command(self, ds_config: dict[str, Any], config_path: Path, *, port_offset: int) -> list[str]:
        """`python -m ds_launcher <the job's flags> --master_port P <script> <its args>`."""
        assert self.args is not None
        port = ["--master_port", str(self.args.master_port + port_offset)]
        script_args = self.script_args(ds_config, config_path)
        return [
            self.python,
            "-m",
            "ds_launcher",
            *launcher_flags(self.args),
            *port,
            self.args.user_script,
            *script_args,
        ]

    def run(self, name: str, ds_config: dict[str, Any], *, autotuning: dict[str, Any]) -> ExperimentResult:
        """Launch experiment `name` with `ds_config` and its `autotuning` section; wait for it.

        `autotuning` gets `enabled: true` and `metric_path` in the experiment's folder (a value from the
        user's config would send every experiment's metrics to one file); a profile run passes
        `model_info: {"profile": true}` and its `model_info_path`, which is then the file to read.
        """
        assert self.results_dir is not None and self.exps_dir is not None
        exp_id = self.experiment_count
        self.experiment_count += 1
        result_dir = (self.results_dir / name).resolve()
        result_dir.mkdir(parents=True, exist_ok=True)
        metric_file = result_dir / "metrics.json"
        config = copy.deepcopy(ds_config)
        section = {k: v for k, v in autotuning.items() if k not in ("results_dir", "exps_dir")}
        section["enabled"] = True
        section["metric_path"] = str(metric_file)
        config["autotuning"] = section
        profile = (section.get("model_info") or {}).get("profile", False)
        output = Path(section["model_info_path"]) if profile else metric_file
        config_path = result_dir / "ds_config.json"
        _write_json(config_path, config)
        cmd = self.command(config, config_path, port_offset=exp_id)
        description = {
            "name": name,
            "exp_id": exp_id,
            "ds_config": config,
            "num_gpus": self.num_gpus_per_node,
            "num_nodes": len(self.nodes),
            "hostfile": getattr(self.args, "hostfile", None),
            "result_dir": str(result_dir),
        }
        self.exps_dir.mkdir(parents=True, exist_ok=True)
        _write_json(self.exps_dir / f"{name}.json", description)
        (result_dir / "cmd.txt").write_text(shlex.join(cmd) + "\n")
        if not self.overwrite and output.is_file():
            logger.info("autotuning: %s has results already; reading them", name)
            return self._result(name, result_dir, output, None, 0.0, cmd, description)
        logger.info("autotuning: running %s: %s", name, shlex.join(cmd))
        started = time.perf_counter()
        with open(result_dir / "stdout.log", "wb") as out, open(result_dir / "stderr.log", "wb") as err:
            status = subprocess.run(cmd, stdout=out, stderr=err, check=False).returncode
        duration_s = time.perf_counter() - started
        error = None
        if status != 0 or not output.is_file():
            error = f"exit status {status}: {_last_error_line(result_dir / 'stderr.log')}"
        return self._result(name, result_dir, output, error, duration_s, cmd, description)

    @staticmethod
    def _result(
        name: str,
        result_dir: Path,
        output: Path,
        error: str | None,
        duration_s: float,
        cmd: list[str],
        description: dict[str, Any],
    ) -> ExperimentResult:
        metrics = None
        if error is None:
            metrics = json.loads(output.read_text())
        description.update(command=cmd, metrics=metrics, error=error, duration_s=duration_s)
        _write_json(result_dir / "exp.json", description)
        if error is not None:
            logger.warning("autotuning: %s failed (%s); see %s", name, error, result_dir / "stderr.log")
        return ExperimentResult(name, result_dir, metrics, error, duration_s, cmd)
