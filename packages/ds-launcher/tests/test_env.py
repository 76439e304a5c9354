"""`.deepspeed_env` parsing and lookup, and which variables are forwarded to remote workers."""

from __future__ import annotations

from pathlib import Path

import pytest

from ds_launcher import EnvFileError, collect_exports, parse_env_file, read_env_files

AWKWARD = {
    "MSG": 'it\'s "quoted" and spaced',
    "DOLLAR": "$HOME `whoami` $(id) ; rm -rf /",
    "EQ": "a=b=c",
    "EMPTY": "",
    "TAB": "x\ty",
    "UNICODE": "naïve café",
}


def _env_text(values: dict[str, str]) -> str:
    return "".join(f"{k}={v}\n" for k, v in values.items())


def test_env_file_values_are_literal() -> None:
    text = "# tuning\n\nexport NCCL_DEBUG=INFO\n  SPACED  =   padded value  \n" + _env_text(AWKWARD)
    assert parse_env_file(text) == {"NCCL_DEBUG": "INFO", "SPACED": "padded value", **AWKWARD}


def test_later_lines_override() -> None:
    assert parse_env_file("A=1\nA=2\n") == {"A": "2"}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("A=1\n\nNOEQUALS\n", "envf:3: 'NOEQUALS' is not KEY=VALUE; write e.g. 'NCCL_DEBUG=INFO'"),
        (
            "1X=2\n",
            "envf:1: '1X' is not a valid environment variable name (letters, digits and '_', not starting "
            "with a digit)",
        ),
        (
            "=value\n",
            "envf:1: '' is not a valid environment variable name (letters, digits and '_', not starting with a digit)",
        ),
        (
            "MY VAR=1\n",
            "envf:1: 'MY VAR' is not a valid environment variable name (letters, digits and '_', not "
            "starting with a digit)",
        ),
    ],
)
def test_bad_env_file_lines(text: str, message: str) -> None:
    with pytest.raises(EnvFileError) as info:
        parse_env_file(text, source="envf")
    assert str(info.value) == message


def test_home_then_cwd_and_ds_env_file(tmp_path: Path) -> None:
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    (home / ".deepspeed_env").write_text("A=home\nB=home\n")
    (cwd / ".deepspeed_env").write_text("B=cwd\n")
    assert read_env_files({}, cwd=str(cwd), home=str(home)) == {"A": "home", "B": "cwd"}
    (cwd / "custom.env").write_text("C=custom\n")
    assert read_env_files({"DS_ENV_FILE": "custom.env"}, cwd=str(cwd), home=str(home)) == {"C": "custom"}
    absolute = tmp_path / "abs.env"
    absolute.write_text("D=abs\n")
    assert read_env_files({"DS_ENV_FILE": str(absolute)}, cwd=str(cwd), home=str(home)) == {"D": "abs"}
    assert read_env_files({"DS_ENV_FILE": "absent.env"}, cwd=str(cwd), home=str(home)) == {}
    with pytest.raises(EnvFileError) as info:
        read_env_files({"DS_ENV_FILE": str(tmp_path / "nope.env")}, cwd=str(cwd), home=str(home))
    assert str(info.value) == (
        f"DS_ENV_FILE='{tmp_path / 'nope.env'}' does not exist; point it at a KEY=VALUE file or unset it"
    )


def test_same_directory_is_read_once(tmp_path: Path) -> None:
    (tmp_path / ".deepspeed_env").write_text("A=1\n")
    assert read_env_files({}, cwd=str(tmp_path), home=str(tmp_path)) == {"A": "1"}


def test_collect_exports_order_and_selection(tmp_path: Path) -> None:
    (tmp_path / ".deepspeed_env").write_text(_env_text(AWKWARD) + "NCCL_DEBUG=WARN\n")
    environ = {
        "PYTHONPATH": "/x:/y",
        "NCCL_DEBUG": "INFO",
        "NCCL_SOCKET_IFNAME": "eth0 ",
        "UCX_TLS": "tcp",
        "HOME": "/h",
        "OTHER": "1",
        "PYTHONHASHSEED": "0",
        "MLFLOW_RUN": "r",
        "MV2_X": "y",
        "DS_ACCELERATOR": "cpu",
        "DEEPSPEED_TIMEOUT": "5",
        "PATH": "/bin",
    }
    exports = collect_exports(environ, cwd=str(tmp_path), home=str(tmp_path / "nohome"))
    assert list(exports.items()) == [
        ("PYTHONPATH", f"{tmp_path}:/x:/y"),
        ("DEEPSPEED_TIMEOUT", "5"),
        ("DS_ACCELERATOR", "cpu"),
        ("MLFLOW_RUN", "r"),
        ("MV2_X", "y"),
        ("NCCL_DEBUG", "WARN"),  # the env file overrides the environment
        ("NCCL_SOCKET_IFNAME", "eth0 "),  # environment values are not altered
        ("PYTHONHASHSEED", "0"),
        ("UCX_TLS", "tcp"),
        *AWKWARD.items(),
    ]


def test_pythonpath_without_existing() -> None:
    assert collect_exports({}, cwd="/job", home="/nonexistent-home") == {"PYTHONPATH": "/job"}
