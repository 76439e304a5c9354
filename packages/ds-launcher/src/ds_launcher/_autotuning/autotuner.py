"""`Autotuner`: `deepspeed --autotuning tune|run` from the user's config to `ds_config_optimal.json`.

The recipe (`tune`):

1. read the script's ds_config and its `autotuning` section; refuse bad values before anything runs;
2. when micro-batch sizes are to be chosen and `model_info.num_params` is not given, run the model
   profile experiment (`profile_model_info`: parameter count and the activation memory of one
   micro-batch, from the engine) to bound the sizes by memory;
3. build the space (`space.py`) and let the `tuner_type` tuner (`tuners.py`) run the experiments
   (`scheduler.py`), one at a time;
4. write `summary.txt`, `trials.json`, `ds_config_optimal.json` (the best experiment's config without
   its `autotuning` section) and `cmd_optimal.txt` (the training command with that config) to
   `results_dir`.

`run_after_tuning` then starts that command: `--autotuning run` trains with the best config.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ds_launcher._autotuning.scheduler import ExperimentScheduler
from ds_launcher._autotuning.settings import AutotuningSettings, find_user_config, read_settings
from ds_launcher._autotuning.space import (
    build_experiments,
    candidate_micro_batches,
    candidate_stages,
    memory_bound,
)
from ds_launcher._autotuning.tuners import Trial, make_tuner

logger = logging.getLogger(__name__)

__all__ = ["Autotuner", "run_autotuning"]

#: The profile experiment's name and config changes (DeepSpeed's minimal-memory config).
PROFILE_NAME = "profile_model_info"


def _metric_of(trial: Trial) -> float:
    """The metric of a trial that has one (what the lists of finished trials hold)."""
    if trial.metric is None:
        raise ValueError(f"experiment {trial.experiment.name!r} has no metric to rank")
    return trial.metric


class Autotuner:
    """Tunes ZeRO stage, micro-batch size (and, with `fast: false`, ZeRO knobs) by running experiments.

    Args:
        args: the parsed `deepspeed` command (`--autotuning tune|run` and the launcher flags, the
            script and its arguments, which must pass the ds_config).
        active_resources: host -> slots the job may use; each experiment uses `--num_nodes` hosts (all)
            and `--num_gpus` slots per host (the fewest any host has).

    Raises:
        ValueError: no ds_config among the script's arguments, or a bad value in it (the message names
            the key path), or more nodes or ranks requested than the resources hold.
    """

    def __init__(self, args: argparse.Namespace, active_resources: Mapping[str, Sequence[int]]) -> None:
        self.args = args
        self.user = find_user_config(args.user_args)
        self.user_config = self.user.config
        self.settings: AutotuningSettings = read_settings(self.user_config)
        self.stages = candidate_stages(self.user_config)
        if not active_resources:
            raise ValueError("--autotuning: no resources to run experiments on")
        hosts = list(active_resources)
        slots = min(len(s) for s in active_resources.values())
        if slots <= 0:
            raise ValueError("--autotuning: a host of the job has no slots")
        self.exps_dir = Path(self.settings.exps_dir)
        self.results_dir = Path(self.settings.results_dir)
        for folder in (self.exps_dir, self.results_dir):
            if self.settings.overwrite and folder.exists():
                shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True, exist_ok=True)
        self.rm = ExperimentScheduler(
            args,
            hosts,
            slots,
            self.results_dir,
            self.exps_dir,
            self.settings.arg_mappings,
            user_config=self.user,
            overwrite=self.settings.overwrite,
        )
        self.exp_num_nodes = args.num_nodes if args.num_nodes > 0 else len(hosts)
        self.exp_num_gpus = args.num_gpus if args.num_gpus > 0 else slots
        if self.exp_num_nodes > len(hosts) or self.exp_num_gpus > slots:
            raise ValueError(
                f"--autotuning: experiments of {self.exp_num_nodes} node(s) x {self.exp_num_gpus} rank(s) do not "
                f"fit the {len(hosts)} host(s) x {slots} slot(s) available"
            )
        self.trials: list[Trial] = []
        self.model_info: dict[str, Any] | None = None
        self.optimal_cmd: list[str] | None = None
        self.optimal_ds_config: dict[str, Any] | None = None
        self.tuning_s = 0.0

    @property
    def num_ranks(self) -> int:
        return self.exp_num_nodes * self.exp_num_gpus

    # -- the search ---------------------------------------------------------------------------------
    def tune(self) -> list[Trial]:
        """Run the search (see the module docstring); returns every trial in order."""
        started = time.perf_counter()
        micro_batches = self._micro_batches()
        experiments = build_experiments(
            self.user_config, self.settings, num_ranks=self.num_ranks, stages=self.stages, micro_batches=micro_batches
        )
        logger.info(
            "autotuning: %d experiment(s) in the space (stages %s, micro-batch sizes %s), tuner %s",
            len(experiments),
            self.stages,
            micro_batches,
            self.settings.tuner_type,
        )
        tuner = make_tuner(self.settings.tuner_type, experiments, higher_is_better=self.settings.higher_is_better)
        self.trials = tuner.tune(
            self._evaluate,
            num_trials=self.settings.tuner_num_trials,
            early_stopping=self.settings.tuner_early_stopping,
        )
        self.tuning_s = time.perf_counter() - started
        return self.trials

    def _evaluate(self, exp: Any) -> float | None:
        result = self.rm.run(exp.name, exp.ds_config, autotuning=dict(self.user_config.get("autotuning") or {}))
        if result.metrics is None:
            return None
        value = result.metrics.get(self.settings.metric)
        return float(value) if value is not None else None

    def _micro_batches(self) -> dict[int, list[int]]:
        explicit = isinstance(self.user_config.get("train_micro_batch_size_per_gpu"), list)
        if not explicit:
            self.model_info = self._model_info()
        return {
            stage: candidate_micro_batches(
                self.user_config, self.settings, num_ranks=self.num_ranks, bound=self._memory_bound(stage)
            )
            for stage in self.stages
        }

    def _memory_bound(self, stage: int) -> int | None:
        if self.model_info is None or not self.model_info.get("activation_mem_per_gpu"):
            return None
        from ds_comm import get_accelerator

        accelerator = get_accelerator()
        memory = float(accelerator.total_memory())
        if accelerator.name == "cpu":  # the ranks of a host share its memory
            memory /= self.exp_num_gpus
        half = any((self.user_config.get(k) or {}).get("enabled", False) for k in ("fp16", "bf16", "bfloat16"))
        return memory_bound(
            self.model_info,
            stage,
            memory_per_rank=memory,
            num_ranks=self.num_ranks,
            half=half,
            mp_size=self.settings.mp_size,
        )

    def _model_info(self) -> dict[str, Any] | None:
        """`model_info` from the config, else measured by the profile experiment (None when it failed)."""
        given = self.settings.model_info
        if given is not None and given.num_params:
            return given.model_dump()
        config = json.loads(json.dumps(self.user_config))
        zero = config.get("zero_optimization") or {}
        config["zero_optimization"] = {k: v for k, v in zero.items() if not isinstance(v, list)}
        config["zero_optimization"]["stage"] = self.stages[-1]  # the least memory among the stages tried
        config["train_micro_batch_size_per_gpu"] = 1
        config["gradient_accumulation_steps"] = 1
        config["train_batch_size"] = max(self.num_ranks // self.settings.mp_size, 1)
        path = (self.results_dir / PROFILE_NAME / "model_info.json").resolve()
        section = dict(config.get("autotuning") or {})
        section.update(model_info={"profile": True}, model_info_path=str(path))
        result = self.rm.run(PROFILE_NAME, config, autotuning=section)
        if result.metrics is None:
            logger.warning(
                "autotuning: the model profile run failed (%s); micro-batch sizes are not bounded by memory",
                result.error,
            )
            return None
        logger.info("autotuning: model profile: %s", result.metrics)
        return result.metrics

    # -- results ------------------------------------------------------------------------------------
    def best_trial(self) -> Trial | None:
        """The trial with the best metric (None when no experiment succeeded)."""
        done = [t for t in self.trials if t.metric is not None]
        if not done:
            return None
        pick = max if self.settings.higher_is_better else min
        return pick(done, key=_metric_of)

    def print_tuning_results(self) -> str:
        """Write (and log) `summary.txt`: the best experiment per stage and overall, and the tuning time."""
        rows = [("tuning_space", "num_experiments", f"best_{self.settings.metric}", "best_exp_name")]
        for stage in self.stages:
            ran = [t for t in self.trials if t.experiment.stage == stage and t.status != "skipped"]
            done = [t for t in ran if t.metric is not None]
            if not ran:
                continue
            pick = max if self.settings.higher_is_better else min
            best = pick(done, key=_metric_of) if done else None
            rows.append(
                (
                    f"z{stage}",
                    str(len(ran)),
                    f"{best.metric:.4g}" if best else "-",
                    best.experiment.name if best else "-",
                )
            )
        best = self.best_trial()
        ran_all = sum(t.status != "skipped" for t in self.trials)
        rows.append(
            ("global", str(ran_all), f"{best.metric:.4g}" if best else "-", best.experiment.name if best else "-")
        )
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows]
        lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
        lines += ["", f"Tuning completed in {self.tuning_s:.1f} s. Total number of experiments: {ran_all}."]
        text = "\n".join(lines) + "\n"
        (self.results_dir / "summary.txt").write_text(text)
        trials = [
            {
                "name": t.experiment.name,
                "stage": t.experiment.stage,
                "micro_batch": t.experiment.micro_batch,
                "gas": t.experiment.gas,
                "status": t.status,
                self.settings.metric: t.metric,
            }
            for t in self.trials
        ]
        (self.results_dir / "trials.json").write_text(json.dumps(trials, indent=2) + "\n")
        logger.info("autotuning results:\n%s", text)
        return text

    def write_optimal_config(self) -> Path | None:
        """`ds_config_optimal.json` and `cmd_optimal.txt` in `results_dir` (None: no experiment succeeded)."""
        best = self.best_trial()
        if best is None:
            logger.warning("autotuning: no experiment succeeded; see the stderr.log files in %s", self.results_dir)
            return None
        config = json.loads((self.results_dir / best.experiment.name / "ds_config.json").read_text())
        config.pop("autotuning", None)
        path = (self.results_dir / "ds_config_optimal.json").resolve()
        path.write_text(json.dumps(config, indent=2) + "\n")
        self.optimal_ds_config = config
        self.optimal_cmd = self.rm.command(config, path, port_offset=0)
        (self.results_dir / "cmd_optimal.txt").write_text(shlex.join(self.optimal_cmd) + "\n")
        logger.info(
            "autotuning: %s is the best; wrote %s and %s",
            best.experiment.name,
            path,
            self.results_dir / "cmd_optimal.txt",
        )
        return path

    def run_after_tuning(self) -> int:
        """Train with the optimal config (`cmd_optimal.txt`); returns the job's exit status."""
        if self.optimal_cmd is None:
            logger.error("autotuning: no optimal config was found; nothing to run")
            return 1
        logger.info("autotuning: training with the optimal config: %s", shlex.join(self.optimal_cmd))
        return subprocess.run(self.optimal_cmd, check=False).returncode


def run_autotuning(args: argparse.Namespace, active_resources: Mapping[str, Sequence[int]]) -> int:
    """`deepspeed --autotuning tune|run`: tune, report, write the optimal config; `run` then trains with it.

    Returns 0 after `tune` when an experiment succeeded (1 when none did), the training job's status after `run`.
    """
    tuner = Autotuner(args, active_resources)
    logger.info("[Start] Running autotuning")
    tuner.tune()
    tuner.print_tuning_results()
    logger.info("[End] Running autotuning")
    if tuner.write_optimal_config() is None:
        return 1
    if args.autotuning == "run":
        return tuner.run_after_tuning()
    return 0
