"""The decisions of `ecrec chaos` (services/ecrec/chaos.py), on plain JSON snapshots: which pod a fault hits,
which injector makes a pod fail, when the job is healthy, what a status says about a fault, the table.
The I/O around them runs against a real API server in tests/k8s/test_chaos_e2e.py and test_helm_e2e.py."""

from __future__ import annotations

import datetime
import random

import pytest

from ecrec import chaos, podlabels
from ecrec.chaos import ChaosError, new_fault, observe

JOB = "j"
T0 = 1_800_000_000.0  # the moment of a fault, as a Unix time


def iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat().replace("+00:00", "Z")


def pod(role: str, index: int = 0, incarnation: int = 1, phase: str = "Running", deleting=False) -> dict:
    labels = {
        podlabels.LABEL_JOB: JOB,
        podlabels.LABEL_ROLE: role,
        podlabels.LABEL_INCARNATION: str(incarnation),
    }
    if role == "server":
        labels[podlabels.LABEL_SHARD] = str(index)
    if role == "worker":
        labels[podlabels.LABEL_RANK] = str(index)
    name = (
        f"{JOB}-coordinator-{incarnation}" if role == "coordinator" else f"{JOB}-{role}-{index}-{incarnation}"
    )
    meta = {"name": name, "labels": labels}
    if deleting:
        meta["deletionTimestamp"] = iso(T0)
    return {"metadata": meta, "spec": {"nodeName": "n1"}, "status": {"phase": phase}}


def cluster(servers: int = 5, workers: int = 2, **replace) -> list[dict]:
    """One running pod per process; `replace={"server-2": [pods]}` swaps a process's pods."""
    pods = {"coordinator-0": [pod("coordinator")]}
    pods |= {f"server-{s}": [pod("server", s)] for s in range(servers)}
    pods |= {f"worker-{r}": [pod("worker", r)] for r in range(workers)}
    pods.update({k.replace("_", "-"): v for k, v in replace.items()})
    return [p for ps in pods.values() for p in ps]


def status(phase="Running", step=100, up=5, recoveries=(), servers=5) -> dict:
    return {
        "phase": phase,
        "step": step,
        "servers": {"up": up, "total": servers},
        "recoveries": list(recoveries),
    }


def rec(shard, state="completed", detected=T0 + 1, continued=T0 + 2, completed=T0 + 9, rows=860) -> dict:
    out = {"shard": shard, "state": state, "detectedAt": iso(detected), "rowsRecovered": rows}
    if continued is not None:
        out["continuedAt"] = iso(continued)
    if completed is not None and state == "completed":
        out["completedAt"] = iso(completed)
    return out


def look(fault, st, pods, now, timeout=300.0):
    return observe(fault, st, pods, 5, 2, now, timeout=timeout, detect_within=13.0)


# -------------------------------------------------------------------------------------- roles, targets --
def test_any_draws_from_one_constant_and_the_coordinator_is_a_target_since_it_fails_over():
    assert chaos.roles_for("any") == chaos.ANY_ROLES
    assert set(chaos.ANY_ROLES) == {"server", "worker", "coordinator"}


def test_targets_are_running_pods_of_the_role_never_one_being_deleted_or_finished():
    pods = cluster(
        server_1=[pod("server", 1, 1, deleting=True), pod("server", 1, 2, phase="Pending")],
        worker_0=[pod("worker", 0, 1, phase="Succeeded")],
    )
    names = [v.name for v in chaos.candidates(pods, "any")]
    assert names == sorted(names)
    assert f"{JOB}-server-1-1" not in names and f"{JOB}-server-1-2" not in names
    assert f"{JOB}-worker-0-1" not in names and f"{JOB}-coordinator-1" in names
    assert {v.role for v in chaos.candidates(pods, "worker")} == {"worker"}
    assert chaos.choose_target([pod("server", 0, phase="Pending")], "server", random.Random(0)) is None


def test_a_seed_picks_the_same_pods_whatever_order_the_api_lists_them_in():
    pods = cluster()
    picks = [chaos.choose_target(pods, "any", rng).name for rng in [random.Random(5)] for _ in range(6)]
    shuffled = list(reversed(pods))
    again = [chaos.choose_target(shuffled, "any", rng).name for rng in [random.Random(5)] for _ in range(6)]
    assert picks == again
    assert len(set(picks)) > 1  # a draw, not always the first


def test_pods_that_are_not_the_jobs_processes_are_ignored():
    stray = {"metadata": {"name": "x", "labels": {podlabels.LABEL_JOB: JOB}}, "status": {"phase": "Running"}}
    bad = pod("server", 0)
    del bad["metadata"]["labels"][podlabels.LABEL_SHARD]
    assert chaos.views([stray, bad]) == []


# -------------------------------------------------------------------------------------------- health --
@pytest.mark.parametrize(
    "st, pods, why",
    [
        (status(phase="Degraded", up=4), cluster(), "phase Degraded"),
        (status(up=4), cluster(), "4/5 servers up"),
        (status(recoveries=[rec(2, state="running")]), cluster(), "recovery of shard 2 is running"),
        (status(), cluster(server_3=[]), "shard 3 has 0 running pods"),
        (status(), cluster(worker_1=[pod("worker", 1, 1), pod("worker", 1, 2)]), "rank 1 has 2 running pods"),
        (status(), cluster(worker_1=[pod("worker", 1, deleting=True)]), "rank 1 has 0 running pods"),
        (status(phase="Failed") | {"reason": "boom"}, cluster(), "phase Failed (boom)"),
    ],
)
def test_unhealthy_says_why(st, pods, why):
    assert chaos.unhealthy(st, pods, 5, 2) == why


def test_healthy_once_everything_runs_and_every_recovery_completed():
    assert chaos.unhealthy(status(recoveries=[rec(2)]), cluster(), 5, 2) is None


# ------------------------------------------------------------------------------------------ injector --
def test_injector_choice():
    assert chaos.choose_injector("auto", chaos_mesh=True, node_honours_annotation=True) == "chaos-mesh"
    assert chaos.choose_injector("auto", chaos_mesh=False, node_honours_annotation=True) == "annotation"
    assert chaos.choose_injector("annotation", chaos_mesh=True, node_honours_annotation=False) == "annotation"
    with pytest.raises(ChaosError, match="needs Chaos Mesh"):
        chaos.choose_injector("auto", chaos_mesh=False, node_honours_annotation=False)
    with pytest.raises(ChaosError, match="install Chaos Mesh"):
        chaos.choose_injector("chaos-mesh", chaos_mesh=False, node_honours_annotation=True)


def test_pod_chaos_selects_exactly_the_target_pod_for_the_duration():
    m = chaos.pod_chaos("c1", "ns", JOB, "j-server-2-1", 20)
    assert m["apiVersion"] == "chaos-mesh.org/v1alpha1" and m["kind"] == "PodChaos"
    assert m["spec"] == {
        "action": "pod-failure",
        "mode": "one",
        "duration": "20s",
        "selector": {"pods": {"ns": ["j-server-2-1"]}},
    }
    assert chaos.pause_patch(7.5, "3-abc") == {
        "metadata": {"annotations": {chaos.PAUSE_SECONDS: "7.5", chaos.PAUSE_ID: "3-abc"}}
    }


# ---------------------------------------------------------------------------------------- server faults --
def server_fault(action="pod-kill", shard=2, before=()):
    target = chaos.view(pod("server", shard))
    return new_fault(1, action, target, status(recoveries=list(before)), T0, duration=20.0)


def test_a_server_fault_is_measured_with_the_coordinators_record_of_it():
    f = server_fault()
    look(f, status(phase="Degraded", up=4), cluster(server_2=[]), T0 + 0.5)
    assert not f.over and f.detected_at is None
    degraded = status(phase="Recovering", up=4, recoveries=[rec(2, state="running", completed=None)])
    replaced = cluster(server_2=[pod("server", 2, 2)])
    look(f, degraded, replaced, T0 + 3)
    assert (
        not f.over and f.rel(f.detected_at) == pytest.approx(1) and f.rel(f.continued_at) == pytest.approx(2)
    )
    look(f, status(recoveries=[rec(2)]), replaced, T0 + 10)
    assert f.outcome == "recovered" and f.rel(f.recovered_at) == pytest.approx(9) and f.rows == 860


def test_an_earlier_recovery_of_the_same_shard_is_not_this_faults():
    old = rec(2, detected=T0 - 100, continued=T0 - 99, completed=T0 - 90)
    f = server_fault(before=[old])
    look(f, status(recoveries=[old]), cluster(), T0 + 5)
    assert not f.over and f.detected_at is None  # the old record is complete, but it is not this fault's
    look(f, status(recoveries=[old, rec(2)]), cluster(), T0 + 10)
    assert f.outcome == "recovered" and f.rel(f.detected_at) == pytest.approx(1)


def test_a_completed_recovery_counts_only_once_the_job_is_healthy_again():
    f = server_fault()
    look(f, status(recoveries=[rec(2)]), cluster(worker_0=[]), T0 + 10)
    assert not f.over
    look(f, status(recoveries=[rec(2)]), cluster(), T0 + 11)
    assert f.outcome == "recovered"


def test_a_pause_the_coordinator_never_noticed_is_undetected_not_recovered():
    f = server_fault("pod-failure")
    look(f, status(), cluster(), T0 + 25)  # pause over, within the detection allowance
    assert not f.over
    look(f, status(), cluster(), T0 + 20 + 14)
    assert f.outcome == "undetected" and f.detected_at is None


def test_a_failed_job_or_recovery_ends_the_fault():
    f = server_fault()
    look(f, status(phase="Failed") | {"reason": "2 servers lost at once"}, cluster(), T0 + 2)
    assert f.outcome == "job failed" and "2 servers lost" in f.note
    g = server_fault()
    look(g, status(recoveries=[rec(2, state="failed") | {"message": "no replacement"}]), cluster(), T0 + 2)
    assert g.outcome == "recovery failed" and g.note == "no replacement"


def test_a_fault_that_does_not_recover_in_time_times_out_saying_why():
    f = server_fault()
    look(f, status(phase="Degraded", up=4), cluster(server_2=[]), T0 + 301, timeout=300)
    assert f.outcome == "timeout" and f.note == "phase Degraded"


# ---------------------------------------------------------------------------------------- worker faults --
def worker_fault(action="pod-kill", rank=1, duration=20.0):
    return new_fault(1, action, chaos.view(pod("worker", rank)), status(), T0, duration=duration)


def test_a_killed_worker_continues_when_its_replacement_runs_and_recovers_when_the_job_steps_again():
    f = worker_fault()
    look(f, status(step=100), cluster(worker_1=[]), T0 + 1)
    look(f, status(step=100), cluster(worker_1=[pod("worker", 1, 2, phase="Pending")]), T0 + 2)
    assert f.continued_at is None
    running = cluster(worker_1=[pod("worker", 1, 2)])
    look(f, status(step=100), running, T0 + 4)
    assert f.rel(f.continued_at) == pytest.approx(4) and not f.over
    look(f, status(step=100), running, T0 + 6)
    assert not f.over  # the job's step has not moved since
    look(f, status(step=101), running, T0 + 8)
    assert f.outcome == "recovered" and f.rel(f.recovered_at) == pytest.approx(8) and f.note == "replaced"


def test_a_killed_coordinator_continues_when_its_successor_runs_and_recovers_when_the_job_steps_again():
    f = new_fault(1, "pod-kill", chaos.view(pod("coordinator")), status(), T0)
    look(f, status(step=100), cluster(coordinator_0=[]), T0 + 1)
    assert f.continued_at is None and not f.over
    successor = cluster(coordinator_0=[pod("coordinator", 0, 2)])
    look(f, status(step=100), successor, T0 + 3)
    assert f.rel(f.continued_at) == pytest.approx(3) and not f.over
    look(f, status(step=104), successor, T0 + 5)
    assert f.outcome == "recovered" and f.note == "replaced"


def test_a_paused_worker_continues_when_its_pause_is_over():
    f = worker_fault("pod-failure", duration=20.0)
    look(f, status(step=100), cluster(), T0 + 10)
    assert f.continued_at is None  # its pod is Running all along: that says nothing
    look(f, status(step=100), cluster(), T0 + 21)
    assert f.rel(f.continued_at) == pytest.approx(20)
    look(f, status(step=102), cluster(), T0 + 23)
    assert f.outcome == "recovered" and f.note == "resumed"


def test_a_worker_fault_ends_when_the_job_finishes():
    f = worker_fault()
    look(f, status(phase="Succeeded", step=500), cluster(worker_1=[]), T0 + 5)
    assert f.outcome == "recovered" and "the job finished" in f.note


# --------------------------------------------------------------------------------------------- table --
def test_the_table_has_a_row_per_fault_with_times_after_the_fault():
    f = server_fault()
    look(f, status(recoveries=[rec(2)]), cluster(), T0 + 10)
    g = worker_fault("pod-failure")
    g.n = 2
    look(g, status(phase="Failed") | {"reason": "boom"}, cluster(), T0 + 3)
    rows = chaos.table_rows([f, g])
    assert len(rows) == 2 and all(len(r) == len(chaos.COLUMNS) for r in rows)
    assert rows[0][:3] == ("1", "pod-kill server 2", f"{JOB}-server-2-1")
    assert rows[0][4:] == ("+1.0s", "+2.0s", "+9.0s", "860", "recovered")
    assert rows[1][1] == "pod-failure worker 1 (20s)" and rows[1][4:7] == ("-", "-", "-")
    assert rows[1][8] == "job failed (boom)"
    assert chaos.fault_dict(f)["recoveredSeconds"] == pytest.approx(9)
