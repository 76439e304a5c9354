"""ds-launcher: the `deepspeed` command, hostfiles, resource filters, env propagation, local and multi-node runners.

Entry points: the `deepspeed` console script (`ds_launcher.runner:cli`, also `python -m ds_launcher`)
and the per-node launcher `python -m ds_launcher.launch`; `deepspeed --autotuning tune|run` runs the
autotuner (`ds_launcher.autotuning`, DeepSpeed's `deepspeed.autotuning`). The names below are the building
blocks, for tools that plan or inspect a launch without running it.
"""

from __future__ import annotations

from ds_launcher.__about__ import __version__
from ds_launcher._env import EnvFileError, collect_exports, parse_env_file, read_env_files
from ds_launcher._hostfile import HostfileError, fetch_hostfile, parse_hostfile
from ds_launcher._mpi_runners import IMPIRunner, MPICHRunner, MVAPICHRunner, OpenMPIRunner
from ds_launcher._remote_runners import PDSHRunner, SSHRunner
from ds_launcher._resources import (
    ResourceFilterError,
    apply_num_nodes_and_gpus,
    decode_world_info,
    encode_world_info,
    filter_resources,
    parse_node_spec,
)
from ds_launcher._runner_base import Command, LauncherNotFoundError, LaunchPlan, MultiNodeRunner
from ds_launcher._slurm_runner import SlurmRunner

__all__ = [
    "Command",
    "EnvFileError",
    "HostfileError",
    "IMPIRunner",
    "LaunchPlan",
    "LauncherNotFoundError",
    "MPICHRunner",
    "MVAPICHRunner",
    "MultiNodeRunner",
    "OpenMPIRunner",
    "PDSHRunner",
    "ResourceFilterError",
    "SSHRunner",
    "SlurmRunner",
    "__version__",
    "apply_num_nodes_and_gpus",
    "collect_exports",
    "decode_world_info",
    "encode_world_info",
    "fetch_hostfile",
    "filter_resources",
    "parse_env_file",
    "parse_hostfile",
    "parse_node_spec",
    "read_env_files",
]
