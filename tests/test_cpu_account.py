"""ecrec.core.cpu: CPU seconds by role, from what each process says of its own counter."""

from __future__ import annotations

import math

import pytest

from ecrec.core.cpu import CpuAccount


def test_each_process_counts_from_its_first_report_and_roles_sum_their_processes():
    acct = CpuAccount()
    acct.report("worker", "w0", 2.0)  # at registration: start-up is not training's cost
    acct.report("worker", "w0", 5.5)
    acct.report("worker", "w1", 1.0)
    acct.report("worker", "w1", 2.0)
    acct.report("server", "s0", 3.0)
    acct.report("server", "s0", 3.25)
    assert acct.by_role() == {"coordinator": 0.0, "server": 0.25, "worker": 4.5}
    assert acct.processes("worker") == 2 and acct.processes("coordinator") == 0


def test_a_replacement_counts_from_its_own_registration_and_the_dead_one_keeps_its_share():
    acct = CpuAccount()
    acct.report("server", "s2-a", 1.0)
    acct.report("server", "s2-a", 4.0)  # then SIGKILLed
    acct.report("server", "s2-b", 1.5)  # its replacement registers
    acct.report("server", "s2-b", 2.0)  # rebuilt and serving
    assert acct.by_role()["server"] == 3.5
    assert acct.by_instance("server") == {"s2-a": 3.0, "s2-b": 0.5}  # each process's own share
    assert acct.by_instance("worker") == {}


def test_a_stale_or_missing_counter_changes_nothing():
    acct = CpuAccount()
    acct.report("worker", "w0", 1.0)
    acct.report("worker", "w0", 3.0)
    acct.report("worker", "w0", 2.0)  # an older report arriving late
    for bad in (None, -1.0, math.nan):  # a process that did not say (an older version), or garbage
        acct.report("worker", "w0", bad)
        acct.report("worker", "w9", bad)
    assert acct.by_role()["worker"] == 2.0 and acct.processes("worker") == 1
    with pytest.raises(ValueError, match="role"):
        acct.report("ps", "x", 1.0)
