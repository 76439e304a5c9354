"""The comms logger's settings read back under DeepSpeed's attribute names, following the profiling switches."""

from __future__ import annotations

import ds_comm
from ds_comm import CommsLogger


def test_defaults_before_configure() -> None:
    log = CommsLogger()
    assert (log.prof_all, log.prof_ops, log.verbose, log.debug) == (True, [], False, False)


def test_switches_change_what_the_attributes_say() -> None:
    log = CommsLogger()
    log.configure(ds_comm.CommsLoggerConfig(enabled=True, prof_all=False, verbose=True))
    assert (log.prof_all, log.verbose, log.debug) == (False, True, False)
    log.start_profiling_comms()
    assert log.prof_all is True and log.should_record("broadcast")
    log.stop_profiling_comms()
    assert log.prof_all is False and not log.should_record("broadcast")
    log.start_profiling_op(["all_reduce"])
    assert log.prof_ops == ["all_reduce"] and log.should_record("all_reduce")
    log.stop_profiling_op(["all_reduce"])
    assert log.prof_ops == [] and not log.should_record("all_reduce")
