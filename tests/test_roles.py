"""One argv builder for every role (ecrec.roles.role_argv): what `ecrec local` forks and the operator's pods run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ecrec.core.roles import PROCESS_ROLES
from ecrec.roles import CPUS_ENV, parse_cpus, role_argv, role_cpus


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_each_role_runs_its_module_with_the_job_and_its_index():
    server = role_argv("server", 3, job="j.json", coordinator="http://c", instance="i", bind="h:1")
    assert (
        server[:2] == ["ecrec", "server"]
        and flag(server, "--shard") == "3"
        and flag(server, "--bind") == "h:1"
    )
    assert flag(server, "--job") == "j.json" and flag(server, "--coordinator") == "http://c"
    assert flag(server, "--instance") == "i" and "--replacement" not in server
    worker = role_argv("worker", 1, job="j", coordinator="c", incarnation=3, replacement=True)
    assert worker[:2] == ["ecrec", "worker"] and flag(worker, "--rank") == "1"
    assert flag(worker, "--incarnation") == "3" and "--replacement" in worker and "--bind" not in worker
    spare = role_argv("spare", 0, job="j", coordinator="c", replacement=True)
    # a spare is a server process without a shard: never a replacement until it takes one over
    assert spare[:2] == ["ecrec", "server"] and flag(spare, "--spare") == "0"
    assert "--shard" not in spare and "--replacement" not in spare


def test_the_coordinator_listens_where_it_is_told_and_a_successor_resumes():
    first = role_argv("coordinator", job="env:J", host="10.0.0.1", port=8080, metrics_port=9090)
    assert first[:2] == ["ecrec", "coordinator"] and flag(first, "--host") == "10.0.0.1"
    assert flag(first, "--port") == "8080" and flag(first, "--metrics-port") == "9090"
    assert "--coordinator" not in first and "--generation" not in first and "--instance" not in first
    successor = role_argv("coordinator", job="j", port=1, resume=(2, "env:R"))
    assert flag(successor, "--generation") == "2" and flag(successor, "--resume") == "env:R"


def test_every_process_role_has_an_argv_and_nothing_else_does():
    for role in PROCESS_ROLES:
        assert role_argv(role, job="j", coordinator="c")[0] == "ecrec"
    with pytest.raises(ValueError, match="not one of"):
        role_argv("scheduler", job="j")


# -- the cores of a role's processes (ECREC_CPUS, `ecrec local --cpus ROLE=CORES`) ----------------------------
PROBE = (
    "import os, sys, types\n"
    "sys.modules['probe'] = types.SimpleNamespace(main=lambda argv: print(sorted(os.sched_getaffinity(0))))\n"
    "import ecrec.roles as roles\n"
    "roles.ROLE_MODULES['worker'] = 'probe'\n"
    "roles.run_role('worker', [])\n"
)


def run_probe(cpus: str) -> subprocess.CompletedProcess:
    env = {**os.environ, CPUS_ENV: cpus}
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)


def test_a_role_process_runs_on_the_cores_it_is_given():
    out = run_probe("0")
    assert out.returncode == 0 and out.stdout.strip() == "[0]", out.stderr
    bad = run_probe("1-0")
    assert bad.returncode != 0 and "runs backwards" in bad.stderr


def test_cores_are_parsed_and_checked_before_anything_starts():
    assert parse_cpus("0-2,5") == {0, 1, 2, 5}
    for text in ("", "a", "3-", "2-1"):
        with pytest.raises(ValueError):
            parse_cpus(text)
    c = min(os.sched_getaffinity(0))  # a core this process may use (under `taskset -c 1`, not core 0)
    assert role_cpus([f"server={c}", f"worker={c}"]) == {"server": str(c), "worker": str(c)}
    with pytest.raises(ValueError, match="ROLE=CORES"):
        role_cpus([f"spare={c}"])
    with pytest.raises(ValueError, match="twice"):
        role_cpus([f"server={c}", f"server={c}"])
    with pytest.raises(ValueError, match="not available"):
        role_cpus([f"worker={max(os.sched_getaffinity(0)) + 1}"])


def test_a_role_runs_with_what_it_imported_out_of_the_collectors_reach():
    """run_role freezes the interpreter's objects (in a real role: torch, gRPC, the role's module) before the
    role's main: a full collection then scans only what the role allocates, not ~200k objects each time."""
    probe = (
        "import gc, sys, types\n"
        "from ecrec import roles\n"
        "stub = types.ModuleType('stub_role')\n"
        "stub.main = lambda argv: print(gc.get_freeze_count(), len(gc.get_objects()), argv)\n"
        "sys.modules['stub_role'] = stub\n"
        "roles.ROLE_MODULES['server'] = 'stub_role'\n"
        "assert gc.get_freeze_count() == 0\n"
        "roles.run_role('server', ['--shard', '1'])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    frozen, left, argv = out.stdout.split(" ", 2)
    assert int(frozen) > 5_000  # the interpreter, ecrec.roles and what it imports
    assert int(left) < int(frozen) // 10  # what a full collection still scans
    assert argv.strip() == "['--shard', '1']"
