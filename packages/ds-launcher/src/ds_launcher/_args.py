"""The `deepspeed` command line: DeepSpeed's flags, names and defaults, plus `--num_procs` and `--launcher ssh`."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ds_launcher._cli_logging import LOG_LEVELS
from ds_launcher._hostfile import DEFAULT_HOSTFILE

#: `--launcher` values, in the order the help lists them.
LAUNCHERS = ("pdsh", "openmpi", "mpich", "impi", "mvapich", "slurm", "ssh")
#: torch.distributed's default rendezvous port.
DEFAULT_MASTER_PORT = 29500


def build_parser() -> argparse.ArgumentParser:
    """The parser; every launcher flag must come before the user script."""
    p = argparse.ArgumentParser(
        prog="deepspeed",
        description="Launch a training script on the local host or on every host of a hostfile. "
        "Launcher flags go before the script; everything after the script is passed to it.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "-H",
        "--hostfile",
        type=str,
        default=None,
        help=f"hostfile with 'hostname slots=N' lines (default: {DEFAULT_HOSTFILE} if it exists, "
        "else this host's devices)",
    )
    p.add_argument(
        "-i",
        "--include",
        type=str,
        default="",
        help="resources to use: NAME[:SLOT[,SLOT...]] joined by '@', e.g. 'worker-0:0,1@worker-1'",
    )
    p.add_argument("-e", "--exclude", type=str, default="", help="resources to skip, same grammar as --include")
    p.add_argument("--num_nodes", type=int, default=-1, help="use the first N hosts of the hostfile")
    p.add_argument(
        "--num_gpus",
        "--num_accelerators",
        "--num_procs",
        dest="num_gpus",
        type=int,
        default=-1,
        help="use slots 0..N-1 on each host; on a CPU host, start N CPU ranks",
    )
    p.add_argument("--min_elastic_nodes", type=int, default=-1, help="not supported (elastic training)")
    p.add_argument("--max_elastic_nodes", type=int, default=-1, help="not supported (elastic training)")
    p.add_argument("--elastic_training", action="store_true", help="not supported")
    p.add_argument("--master_port", type=int, default=DEFAULT_MASTER_PORT, help="rank 0's rendezvous port")
    p.add_argument(
        "--master_addr",
        type=str,
        default="",
        help="rank 0's address (default: 127.0.0.1 on one host, else found from the first host)",
    )
    p.add_argument("--node_rank", type=int, default=-1, help="this node's index; with --no_ssh")
    p.add_argument("--launcher", type=str.lower, default="pdsh", choices=LAUNCHERS, help="multi-node backend")
    p.add_argument("--launcher_args", type=str, default="", help="extra arguments for the backend (shell-split)")
    p.add_argument("--module", action="store_true", help="run the script as a module (python -m)")
    p.add_argument("--no_python", action="store_true", help="execute the script directly, without python")
    p.add_argument("--no_local_rank", action="store_true", help="do not pass --local_rank=N to the script")
    p.add_argument("--no_ssh", action="store_true", help="start only this node's part (needs --node_rank)")
    p.add_argument("--no_ssh_check", action="store_true", help="skip the passwordless-ssh check")
    p.add_argument("--force_multi", action="store_true", help="use the multi-node backend even for one host")
    p.add_argument("--save_pid", action="store_true", help="write the launcher's pid to /tmp/<runner pid>.deepspeed")
    p.add_argument("--enable_each_rank_log", type=str, default="None", help="directory for per-rank logs")
    p.add_argument(
        "--autotuning",
        type=str,
        default="",
        choices=["", "tune", "run"],
        help="tune: find the best ZeRO stage and micro-batch size (the ds_config's autotuning section) and write "
        "autotuning_results/ds_config_optimal.json; run: tune, then train with it",
    )
    p.add_argument("--bind_cores_to_rank", action="store_true", help="pin each rank to its share of the cores")
    p.add_argument("--bind_core_list", type=str, default=None, help="cores to share out, e.g. '0,2-5'")
    p.add_argument("--ssh_port", type=int, default=None, help="ssh port for the ssh check, ssh and pdsh")
    p.add_argument("--venv_script", type=str, default=None, help="pdsh/ssh: a script to source on each node first")
    p.add_argument("--comment", dest="slurm_comment", type=str, default="", help="slurm: srun --comment")
    p.add_argument("--log_level", type=str.lower, default="info", choices=LOG_LEVELS, help="launcher log level")
    p.add_argument("-q", "--quiet", action="store_true", help="log errors only")
    p.add_argument("user_script", type=str, help="the training script (or module, or program)")
    p.add_argument("user_args", nargs=argparse.REMAINDER, help="arguments for the training script")
    return p


def parse_args(args: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse `deepspeed` arguments (`args`, DeepSpeed's parameter name, defaults to `sys.argv[1:]`)."""
    return build_parser().parse_args(args)
