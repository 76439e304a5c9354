"""ds records reach DeepSpeed's "DeepSpeed" logger, following its level, handlers and `propagate`.

Once `ds_engine.utils.logging` is imported (by `import ds_engine` / `import deepspeed`), the "DeepSpeed"
logger is the parent of every ds package's root logger: with default settings each record is printed
once; a DeepSpeed-style setup (own handler, propagate off) gets every ds record once and root none; the
level of "DeepSpeed" decides what a ds logger at NOTSET emits; `propagate = True` lets `caplog` see them.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

import ds_comm
from ds_engine.utils.logging import DS_LOGGERS, logger

DEEPSPEED = logging.getLogger("DeepSpeed")


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def deepspeed_handler() -> Iterator[_Collect]:
    """A handler on "DeepSpeed"; its level and `propagate` are restored afterwards."""
    handler = _Collect()
    saved = (DEEPSPEED.level, DEEPSPEED.propagate)
    DEEPSPEED.addHandler(handler)
    try:
        yield handler
    finally:
        DEEPSPEED.removeHandler(handler)
        DEEPSPEED.setLevel(saved[0])
        DEEPSPEED.propagate = saved[1]


def test_the_utils_logger_is_deepspeeds_and_parents_every_ds_root() -> None:
    assert logger is DEEPSPEED
    for name in DS_LOGGERS[1:]:
        assert logging.getLogger(name).parent is DEEPSPEED, name
    assert logging.getLogger("ds_zero._stage3.optimizer").parent is logging.getLogger("ds_zero")


def test_deepspeed_level_decides_what_ds_loggers_emit(deepspeed_handler: _Collect) -> None:
    ds_zero_log = logging.getLogger("ds_zero.some_module")
    DEEPSPEED.setLevel(logging.INFO)
    ds_zero_log.info("zero info")
    ds_comm.log_dist("rank info", ranks=[0])  # the shared `ds` logger
    ds_zero_log.debug("below INFO")
    DEEPSPEED.setLevel(logging.WARNING)
    ds_zero_log.info("hidden info")
    ds_zero_log.warning("zero warning")
    assert deepspeed_handler.messages == ["zero info", "[Rank 0] rank info", "zero warning"]


def test_propagate_true_lets_caplog_see_ds_records(
    deepspeed_handler: _Collect, caplog: pytest.LogCaptureFixture
) -> None:
    DEEPSPEED.propagate = True
    with caplog.at_level(logging.INFO, logger="DeepSpeed"):
        logging.getLogger("ds_engine.x").info("seen by caplog")
    assert [r.getMessage() for r in caplog.records] == ["seen by caplog"]
    DEEPSPEED.propagate = False
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="DeepSpeed"):
        logging.getLogger("ds_engine.x").info("only the DeepSpeed handler")
    assert caplog.records == []
    assert deepspeed_handler.messages == ["seen by caplog", "only the DeepSpeed handler"]


_SCRIPT = textwrap.dedent("""
    import logging, sys
    setup = sys.argv[1]
    if setup == "root":
        logging.basicConfig(stream=sys.stderr, format="%(message)s")
    if setup == "deepspeed_style":  # DeepSpeed's own: a handler on "DeepSpeed", propagate off; root too
        logging.basicConfig(stream=sys.stderr, format="root %(message)s")
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("ds %(message)s"))
        logging.getLogger("DeepSpeed").addHandler(handler)
        logging.getLogger("DeepSpeed").propagate = False
    import ds_engine
    import ds_comm
    logging.getLogger("ds_zero.x").warning("zero warning")
    ds_comm.log_dist("dist warning", ranks=[0], level=logging.WARNING)
""")


@pytest.mark.parametrize(
    ("setup", "prefix"), [("default", ""), ("root", ""), ("deepspeed_style", "ds ")], ids=lambda v: v or "-"
)
def test_each_record_is_printed_once(setup: str, prefix: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, setup], capture_output=True, text=True, timeout=120, check=True
    )
    lines = (out.stdout + out.stderr).splitlines()
    assert [line for line in lines if "warning" in line] == [f"{prefix}zero warning", f"{prefix}[Rank 0] dist warning"]
