"""The SLURM runner: one `srun` job step over the active hosts."""

from __future__ import annotations

from ds_launcher._runner_base import (
    Command,
    MultiNodeRunner,
    python_command,
    require_equal_slots,
    require_prefix_slots,
)


class SlurmRunner(MultiNodeRunner):
    """`srun -n N --ntasks-per-node P [args] [--comment C] [--nodelist ... --nodes K] --export=ALL python -u script`.

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
        argv = ["srun", "-n", str(plan.world_size), "--ntasks-per-node", str(per_node), *plan.launcher_args]
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
        return [Command("srun", [*argv, *python_command(plan)], env)]
