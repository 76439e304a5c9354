"""DeepSpeed's launcher API names (`runner.parse_resource_filter`, `_parse_hostfile`, `main(args=)`,
`multinode_runner.*`) give the same results as ds-launcher's own functions and runners."""

from __future__ import annotations

import base64
import json
import os
import shlex

import pytest

from ds_launcher import multinode_runner as mnr
from ds_launcher import runner
from ds_launcher._args import parse_args
from ds_launcher._env import collect_exports
from ds_launcher._mpi_runners import OpenMPIRunner as DsOpenMPI
from ds_launcher._resources import encode_world_info
from ds_launcher.runner import build_plan

POOL = {"n0": 2, "n1": 2}
ACTIVE = {"n0": [0, 1], "n1": [0, 1]}


# --- runner: resource filter, hostfile lines, main ---------------------------------------------


def test_parse_resource_filter_on_slot_lists() -> None:
    hosts = {"a": [0, 1, 2], "b": [0, 1, 2]}
    assert runner.parse_resource_filter(hosts) == hosts
    assert runner.parse_resource_filter(hosts, include_str="b:2@a:0") == {"a": [0], "b": [2]}
    assert runner.parse_resource_filter(hosts, exclude_str="a@b:0") == {"b": [1, 2]}
    # excluding everything is an empty selection here, not an error (DeepSpeed's contract)
    assert runner.parse_resource_filter(hosts, exclude_str="a@b") == {}
    assert hosts == {"a": [0, 1, 2], "b": [0, 1, 2]}  # the argument is not modified


@pytest.mark.parametrize(
    ("include", "exclude", "needle"),
    [("a", "b", "mutually exclusive"), ("zz", "", "'zz' is not in the hostfile"), ("", "a:7", "no slot 7")],
)
def test_parse_resource_filter_errors_name_the_problem(include: str, exclude: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        runner.parse_resource_filter({"a": [0, 1], "b": [0]}, include_str=include, exclude_str=exclude)


def test_parse_resource_filter_names_the_slots_a_host_has() -> None:
    with pytest.raises(ValueError, match=r"host 'a' has no slot 1 \(slots: 0,2\)"):
        runner.parse_resource_filter({"a": [0, 2]}, include_str="a:1")
    assert runner.parse_resource_filter({"a": [0, 2, 5]}, exclude_str="a:2") == {"a": [0, 5]}


def test_launch_path_still_refuses_an_empty_selection() -> None:
    with pytest.raises(ValueError, match="leaves no resources"):
        runner.filter_resources({"a": 2}, exclude="a")


def test_parse_hostfile_lines_matches_parse_hostfile() -> None:
    lines = ["  # cluster", "n0 slots=2", "", "10.0.0.7 slots=8 max_slots=8  # gpu box"]
    assert runner._parse_hostfile(lines) == {"n0": 2, "10.0.0.7": 8}
    assert list(runner._parse_hostfile(lines)) == ["n0", "10.0.0.7"]
    for bad in (["n0 slots=2", "n0 slots=1"], ["n0 two words slots=1"], ["n0"], ["   ", "# only a comment"]):
        with pytest.raises(ValueError):
            runner._parse_hostfile(bad)


def test_main_raises_on_bad_flags_and_cli_reports_them(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--num_gpus", "1", "--include", "localhost", "job.py"]
    with pytest.raises(ValueError, match="--num_nodes/--num_gpus cannot be combined with --include/--exclude"):
        runner.main(args=argv)
    assert runner.cli(argv) == 2
    assert "error: --num_nodes/--num_gpus cannot be combined" in capsys.readouterr().err


# --- multinode_runner ----------------------------------------------------------------------------


class _Recorder(mnr.MultiNodeRunner):
    def backend_exists(self) -> bool:
        return True

    def get_cmd(self, environment, active_resources):  # type: ignore[no-untyped-def]
        return sorted(self.exports.items())


def test_add_export_quotes_like_deepspeed() -> None:
    r = _Recorder(parse_args(["job.py", "--x", "1"]), encode_world_info(ACTIVE))
    assert r.name == "_Recorder"
    assert r.user_script == "job.py" and r.user_arguments == ["--x", "1"]
    r.add_export(" PYTHONPATH ", " /opt/lib/py-3.11:/srv/x_y@z+1=2,3%% ")
    r.add_export("SLURM_JOB_CPUS_PER_NODE", "64(x2)")
    r.add_export("NCCL_DEBUG", "")
    assert r.get_cmd({}, {}) == [
        ("NCCL_DEBUG", ""),
        ("PYTHONPATH", "/opt/lib/py-3.11:/srv/x_y@z+1=2,3%%"),
        ("SLURM_JOB_CPUS_PER_NODE", '"64(x2)"'),
    ]


def _same_as_ds(adapter_argv: list[str], ds_runner_cls: type, args_list: list[str], exports: dict[str, str]) -> None:
    args = parse_args(args_list)
    plan = build_plan(args, ACTIVE, master_addr=args.master_addr, cwd=os.getcwd())
    (expected,) = ds_runner_cls(plan).commands(exports)
    assert adapter_argv == expected.argv


def test_pdsh_adapter_builds_ds_command_with_raw_export_values() -> None:
    args_list = ["--master_addr", "n0", "--ssh_port", "2222", "job.py", "--msg", "a b"]
    r = mnr.PDSHRunner(parse_args(args_list), encode_world_info(ACTIVE))
    assert r.name == "pdsh"
    r.add_export("ODD", "64(x2) $HOME")
    env = {"KEEP": "1"}
    cmd, kill_cmd, out_env = r.get_cmd(env, POOL)  # resource pool counts are taken as slots 0..n-1
    assert out_env is env and env == {"KEEP": "1", "PDSH_RCMD_TYPE": "ssh", "PDSH_SSH_ARGS_APPEND": "-p 2222"}
    from ds_launcher._remote_runners import PDSHRunner

    _same_as_ds(cmd, PDSHRunner, args_list, {"ODD": "64(x2) $HOME"})
    # the remote shell gets the value once, single-quoted: no double quotes from `exports`
    assert "export ODD=" + shlex.quote("64(x2) $HOME") in cmd[-1]
    assert kill_cmd[:6] == cmd[:6] and kill_cmd[-1].startswith("pkill -TERM -f -- ")


def test_openmpi_adapter_adds_deepspeed_default_interface_unless_given() -> None:
    args_list = ["--master_addr", "n0", "job.py"]
    r = mnr.OpenMPIRunner(parse_args(args_list), encode_world_info(ACTIVE), POOL)
    assert r.resource_pool == POOL and r.name == "openmpi"
    cmd = r.get_cmd({}, ACTIVE)
    i = cmd.index("btl_tcp_if_include")
    assert cmd[i - 1 : i + 2] == ["--mca", "btl_tcp_if_include", "eth0"]
    # without the adapter's default the command is ds-launcher's own, minus those three words
    _same_as_ds(cmd[: i - 1] + cmd[i + 2 :], DsOpenMPI, args_list, {})
    for given in ("--mca btl_tcp_if_include ib0", "-mca btl_tcp_if_include=ib0"):
        args = parse_args(["--launcher_args", given, "job.py"])
        cmd = mnr.OpenMPIRunner(args, encode_world_info(ACTIVE), POOL).get_cmd({}, ACTIVE)
        assert "eth0" not in cmd and cmd.count("btl_tcp_if_include") + cmd.count("btl_tcp_if_include=ib0") == 1


@pytest.mark.parametrize("name", ["MPICHRunner", "IMPIRunner", "MVAPICHRunner", "SlurmRunner"])
def test_mpi_style_adapters_match_ds_runners(name: str, tmp_path: pytest.TempPathFactory) -> None:
    import ds_launcher._mpi_runners as mpi
    import ds_launcher._slurm_runner as slurm

    ds_cls = getattr(mpi, name, None) or getattr(slurm, name)
    args_list = ["--master_addr", "n0", "--master_port", str(40000 + len(name)), "job.py", "--lr", "0.1"]
    r = getattr(mnr, name)(parse_args(args_list), encode_world_info(ACTIVE), POOL)
    r.add_export("NCCL_IB_HCA", "mlx5_0")
    env: dict[str, str] = {}
    cmd = r.get_cmd(env, ACTIVE)
    _same_as_ds(cmd, ds_cls, args_list, {"NCCL_IB_HCA": "mlx5_0"})
    if name == "SlurmRunner":  # srun forwards its own environment: the exports travel there
        assert env["NCCL_IB_HCA"] == "mlx5_0" and env["MASTER_ADDR"] == "n0"
    else:
        assert env == {}


def test_adapter_rejects_selections_its_backend_cannot_run() -> None:
    r = mnr.SlurmRunner(parse_args(["job.py"]), encode_world_info(ACTIVE), POOL)
    with pytest.raises(ValueError, match="same slot count"):
        r.get_cmd({}, {"n0": [0, 1], "n1": [0]})
    with pytest.raises(ValueError, match="active_resources is empty"):
        r.get_cmd({}, {})


def test_backend_exists_follows_path(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    r = mnr.PDSHRunner(parse_args(["job.py"]), encode_world_info(ACTIVE))
    monkeypatch.setenv("PATH", str(tmp_path))
    assert not r.backend_exists()
    tool = tmp_path / "pdsh"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    assert r.backend_exists()


def test_bad_world_info_is_named() -> None:
    r = mnr.PDSHRunner(parse_args(["job.py"]), "not base64 json!")
    with pytest.raises(ValueError, match="world_info_base64"):
        r.backend_exists()
    listed = base64.urlsafe_b64encode(json.dumps([1, 2]).encode()).decode()
    with pytest.raises(ValueError, match="expected a"):
        mnr.PDSHRunner(parse_args(["job.py"]), listed).backend_exists()


def test_collect_exports_feed_add_export(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The exports the `deepspeed` command forwards can be handed to an adapter unchanged."""
    exports = collect_exports({"NCCL_X": "a b", "PATH": "/bin"}, cwd=str(tmp_path), home=str(tmp_path))
    r = mnr.MPICHRunner(parse_args(["--master_addr", "n0", "job.py"]), encode_world_info(ACTIVE), POOL)
    for key, value in exports.items():
        r.add_export(key, value)
    cmd = r.get_cmd({}, ACTIVE)
    i = cmd.index("NCCL_X")
    assert cmd[i - 1 : i + 2] == ["-genv", "NCCL_X", "a b"]
