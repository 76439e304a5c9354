"""The SLURM runner: one `srun` job step over the active hosts."""

from __future__ import annotations

import re

from ds_launcher._runner_base import (
    Command,
    MultiNodeRunner,
    python_command,
    require_equal_slots,
    require_prefix_slots,
)

#: srun's line for a task that failed by itself: `srun: error: node1: task 3: Exited with exit code 1`
#: (tasks it then kills are reported as `Killed`/`Terminated`, which do not match).
_SRUN_TASK_FAILED = re.compile(r"^srun: error: \S+: tasks? [0-9,\-\[\]]+: Exited with exit code (\d+)")


def srun_task_failure(line: str) -> int | None:
    """The exit status in srun's report of a failed task, or None for any other line.

    srun exits with the largest status of all tasks, which after `--kill-on-bad-exit` is the
    signal status of the tasks it killed (143), not the failing rank's; the runner reads the
    failing task's own status from this line.
    """
    match = _SRUN_TASK_FAILED.match(line)
    return (int(match.group(1)) or None) if match else None


class SlurmRunner(MultiNodeRunner):
    """`srun -n N --ntasks-per-node P --kill-on-bad-exit=1 --quit-on-interrupt [args] [--comment C]
    [--nodelist ... --nodes K] --export=ALL python -u script`.

    The forwarded variables travel in srun's own environment, which `--export=ALL` hands to every
    task. (Putting them in `--export=ALL,K=V` would break on values that contain a comma.) Ranks
    find their place from SLURM_PROCID/SLURM_LOCALID through `ds_comm.init_distributed()`.
    """

    name = "slurm"
    tool = "sinfo"
    provider = "the SLURM client tools (srun, sinfo: apt-get install slurm-client)"

    @classmethod
    def validate_active_resources(cls, active: dict[str, list[int]]) -> None:
        require_prefix_slots(cls.name, active)
        require_equal_slots(cls.name, active)

    def commands(self, exports: dict[str, str]) -> list[Command]:
        plan = self.plan
        per_node = len(next(iter(plan.active.values())))
        # --kill-on-bad-exit: one task failing ends the step (srun otherwise waits for every task, and the
        # others may never finish without it). --quit-on-interrupt: the SIGINT the runner forwards ends the
        # step (a single one otherwise only prints its status). Before the user's arguments, which come later.
        argv = [
            "srun",
            "-n",
            str(plan.world_size),
            "--ntasks-per-node",
            str(per_node),
            "--kill-on-bad-exit=1",
            "--quit-on-interrupt",
            *plan.launcher_args,
        ]
        if plan.slurm_comment:
            argv += ["--comment", plan.slurm_comment]
        if plan.filtered:
            argv += ["--nodelist", ",".join(plan.hosts), "--nodes", str(len(plan.hosts))]
        elif plan.num_nodes > 0:
            argv += ["--nodes", str(plan.num_nodes)]
        if plan.num_gpus > 0:
            argv += ["--gpus-per-node", str(plan.num_gpus)]
        argv.append("--export=ALL")
        env = {**exports, "MASTER_ADDR": plan.master_addr, "MASTER_PORT": str(plan.master_port)}
        return [Command("srun", [*argv, *python_command(plan)], env, stderr_watch=srun_task_failure)]
