"""The pure reconciler shared by the operator and the local launcher: observations in, actions out."""

from __future__ import annotations

from ecrec.core.reconcile import Action, Observed, Proc, coordinator_seed, reconcile, replacements_seen

N, W = 3, 2


def status(phase="Running", shards=None, workers=None, recoveries=()):
    shards = shards or {}
    return {
        "phase": phase,
        "cluster": {
            "shards": [
                {"shard": s, "state": "up", "incarnation": 1, "instance": f"s{s}-1", **shards.get(s, {})}
                for s in range(N)
            ]
        },
        "workers": [
            {
                "rank": r,
                "instance": f"w{r}-1",
                "incarnation": 1,
                "done": False,
                "lost": False,
                **(workers or {}).get(r, {}),
            }
            for r in range(W)
        ],
        "recoveries": list(recoveries),
    }


def running(**skip) -> list[Proc]:
    procs = [Proc("coordinator", 0, 1, "running", "c")]
    procs += [Proc("server", s, 1, "running", f"s{s}-1") for s in range(N)]
    procs += [Proc("worker", r, 1, "running", f"w{r}-1") for r in range(W)]
    return procs


def obs(procs, st, **kw) -> Observed:
    return Observed(N, W, tuple(procs), st, **kw)


def without(procs, role, index):
    return [p for p in procs if (p.role, p.index) != (role, index)]


def test_a_new_job_gets_every_process_once():
    acts = reconcile(obs([], None))
    assert Action("create", "coordinator", 0, 1) in acts
    assert [a for a in acts if a.role == "server"] == [Action("create", "server", s, 1) for s in range(N)]
    assert [a for a in acts if a.role == "worker"] == [Action("create", "worker", r, 1) for r in range(W)]
    assert reconcile(obs(running(), status())) == []


def test_a_deleted_server_is_reported_and_replaced_once_then_recovered():
    procs = without(running(), "server", 1)
    acts = reconcile(obs(procs, status()))
    assert acts == [
        Action("report_failed", "server", 1),
        Action("create", "server", 1, 2, replacement=True),
    ]
    # The replacement exists but has not registered; the coordinator has marked the shard failed: wait.
    procs.append(Proc("server", 1, 2, "pending", "s1-2"))
    st = status(shards={1: {"state": "failed"}})
    assert reconcile(obs(procs, st)) == []
    assert reconcile(obs(procs, st)) == []  # a duplicate event changes nothing
    # Registered: start the rebuild, once.
    st = status(shards={1: {"state": "recovering", "incarnation": 2, "instance": "s1-2"}})
    assert reconcile(obs(procs, st)) == [Action("start_recovery", "server", 1)]
    st["recoveries"] = [{"shard": 1, "state": "running"}]
    assert reconcile(obs(procs, st)) == []


def test_a_terminating_pod_does_not_delay_its_replacement_and_names_never_repeat():
    procs = without(running(), "server", 2) + [Proc("server", 2, 1, "deleting", "s2-1")]
    acts = reconcile(obs(procs, status()))
    assert Action("create", "server", 2, 2, replacement=True) in acts
    # After an operator restart the cluster says incarnation 4 was the last one created, pod gone since.
    st = status(shards={2: {"state": "failed", "incarnation": 4, "instance": "s2-4"}})
    acts = reconcile(obs(without(running(), "server", 2), st))
    assert acts == [Action("create", "server", 2, 5, replacement=True)]


def test_a_hung_server_the_coordinator_declared_failed_is_deleted():
    st = status(shards={0: {"state": "failed"}})
    acts = reconcile(obs(running(), st))
    assert acts == [
        Action("delete", "server", 0, 1, instance="s0-1", reason="the coordinator declared it failed")
    ]


def test_a_superseded_live_process_is_deleted():
    procs = running() + [Proc("server", 0, 2, "running", "s0-2")]
    st = status(
        shards={0: {"state": "recovering", "incarnation": 2, "instance": "s0-2"}},
        recoveries=[{"shard": 0, "state": "running"}],
    )
    acts = reconcile(obs(procs, st))
    assert [a.kind for a in acts] == ["delete"] and acts[0].instance == "s0-1"


def test_a_killed_worker_is_reported_lost_and_resumed_under_its_rank():
    procs = without(running(), "worker", 1) + [Proc("worker", 1, 1, "failed", "w1-1", exit_code=137)]
    acts = reconcile(obs(procs, status()))
    assert acts == [  # (the exit code goes into the coordinator's worker_lost event)
        Action("report_worker_lost", "worker", 1, 1, instance="w1-1", reason="exited with code 137"),
        Action("create", "worker", 1, 2, replacement=True),
    ]
    # Reported lost, replacement not seen yet (e.g. the launcher restarted): create it, do not report again.
    st = status(workers={1: {"lost": True}})
    assert reconcile(obs(procs, st)) == [Action("create", "worker", 1, 2, replacement=True)]


def test_a_finished_worker_is_never_recreated_and_an_erroring_one_fails_the_job():
    procs = without(running(), "worker", 0) + [Proc("worker", 0, 1, "succeeded", "w0-1", exit_code=0)]
    assert reconcile(obs(procs, status(workers={0: {"done": True}}))) == []
    procs = without(running(), "worker", 0) + [Proc("worker", 0, 1, "failed", "w0-1", exit_code=1)]
    (act,) = reconcile(obs(procs, status()))
    assert act.kind == "fail" and "worker 0 exited with code 1" in act.reason


def test_a_worker_that_exited_0_unknown_to_the_coordinator_as_done_is_reported_finished_not_recreated():
    # Its last report reached a coordinator that died before its state was saved: this one started from an
    # older copy, and only the launcher, which saw the exit, can tell it.
    procs = without(running(), "worker", 0) + [Proc("worker", 0, 1, "succeeded", "w0-1", exit_code=0)]
    assert reconcile(obs(procs, status())) == [
        Action("report_worker_finished", "worker", 0, 1, instance="w0-1")
    ]
    assert reconcile(obs(procs, status(workers={0: {"done": True}}))) == []  # it knows: nothing to say
    # a process of another incarnation than the one the coordinator lists proves nothing about that one
    assert reconcile(obs(procs, status(workers={0: {"instance": "w0-2", "incarnation": 2}}))) == []


def test_nothing_is_created_once_the_job_is_over_or_deleted():
    procs = without(without(running(), "server", 1), "worker", 0)
    for phase in ("Succeeded", "Failed"):
        assert reconcile(obs(procs, status(phase=phase))) == []
    assert reconcile(obs(procs, status(), deleting=True)) == []
    # The local launcher keeps servers whole after training for its final checks; workers stay finished.
    acts = reconcile(obs(procs, status(phase="Succeeded"), settle_after_finish=True))
    assert {a.role for a in acts} == {"server"}


def test_limits_and_unrecoverable_losses_fail_the_job_with_the_reason():
    procs = without(running(), "server", 1)
    (act,) = reconcile(obs(procs, status(), replacements=3, backoff_limit=3))
    assert act.kind == "fail" and "backoffLimit" in act.reason
    dead = without(running(), "server", 1) + [Proc("server", 1, 1, "failed", "s1-1", exit_code=137)]
    (act,) = reconcile(obs(dead, status(), recoverable=False))
    assert act.kind == "fail" and "server 1" in act.reason
    # A replaced coordinator counts against the limit like any other process.
    gone = without(running(), "coordinator", 0) + [Proc("coordinator", 0, 1, "failed", "c", exit_code=137)]
    (act,) = reconcile(obs(gone, None, replacements=3, backoff_limit=3))
    assert act.kind == "fail" and "backoffLimit" in act.reason


def test_a_lost_coordinator_is_replaced_by_the_next_incarnation_and_nothing_else_is_decided():
    # Whatever its last status said (read before it died, or nothing), the launcher's only move is a new
    # coordinator: a lost server or worker is handled once that one answers.
    procs = without(running(), "coordinator", 0) + [Proc("coordinator", 0, 1, "failed", "c", exit_code=137)]
    procs = without(procs, "server", 2)
    for st in (None, status(shards={2: {"state": "failed"}})):
        assert reconcile(obs(procs, st)) == [Action("create", "coordinator", 0, 2, replacement=True)]
    deleting = procs[:-1] + [Proc("coordinator", 0, 2, "deleting", "c2")]
    assert reconcile(obs(deleting, None)) == [Action("create", "coordinator", 0, 3, replacement=True)]
    # Its pod already removed (a deleted pod vanishes): the launcher's record says one existed.
    gone = without(running(), "coordinator", 0)
    assert reconcile(obs(gone, None, coordinator_incarnation=2)) == [
        Action("create", "coordinator", 0, 3, replacement=True)
    ]
    assert Action("create", "coordinator", 0, 1) in reconcile(obs([], None))
    # Never while the job is being deleted, nor once it has finished.
    assert reconcile(obs(procs, None, deleting=True)) == []
    assert reconcile(obs(procs, status(phase="Failed"))) == []


def test_a_coordinator_seed_marks_finished_workers_done_and_outranks_its_generation():
    resume = {
        "generation": 4,
        "epoch": 3 * 2**32 + 9,
        "workers": [
            {"rank": 0, "instance": "w0", "step": 90, "done": False, "lost": False},
            {"rank": 1, "instance": "w1", "step": 40, "done": False, "lost": False},
        ],
    }
    procs = (Proc("worker", 0, 1, "succeeded", "w0"), Proc("worker", 1, 1, "running", "w1"))
    generation, seed = coordinator_seed(resume, procs, incarnation=2)
    assert generation == 5  # the seed's generation wins over a smaller pod incarnation
    assert [w["done"] for w in seed["workers"]] == [True, False]
    assert resume["workers"][0]["done"] is False  # the launcher's copy is not changed
    assert coordinator_seed(None, (), incarnation=3) == (3, {"workers": []})


def test_without_the_coordinator_nothing_is_replaced_on_guesswork():
    procs = without(running(), "server", 1) + [Proc("server", 1, 1, "failed", "s1-1", exit_code=1)]
    assert reconcile(obs(procs, None)) == []


def test_an_unresponsive_worker_is_deleted_then_reported_lost_and_replaced():
    st = status(workers={1: {"unresponsive": True}})
    assert reconcile(obs(running(), st)) == [
        Action("delete", "worker", 1, 1, instance="w1-1", reason="the coordinator declared it unresponsive")
    ]
    # Its pod is terminating: no second delete; it is lost, so reported and replaced (as a killed worker).
    procs = without(running(), "worker", 1) + [Proc("worker", 1, 1, "deleting", "w1-1")]
    assert reconcile(obs(procs, st)) == [
        Action("report_worker_lost", "worker", 1, 1, instance="w1-1", reason="gone"),
        Action("create", "worker", 1, 2, replacement=True),
    ]
    # The flag names another process (a replacement registered since): the live one is left alone.
    st = status(workers={1: {"unresponsive": True, "instance": "w1-2", "incarnation": 2}})
    procs = without(running(), "worker", 1) + [Proc("worker", 1, 2, "running", "w1-2")]
    assert reconcile(obs(procs, st)) == [
        Action("delete", "worker", 1, 2, instance="w1-2", reason="the coordinator declared it unresponsive")
    ]
    procs = without(running(), "worker", 1) + [Proc("worker", 1, 3, "running", "w1-3")]
    assert reconcile(obs(procs, st)) == []


# -- warm spares ---------------------------------------------------------------------------------------------


def with_spares(st: dict, *spares: tuple[str, int | None]) -> dict:
    return {**st, "spares": [{"instance": i, "address": "", "assigned": a} for i, a in spares]}


def test_a_job_with_spares_starts_them_once_the_coordinator_answers_and_keeps_them():
    assert not [a for a in reconcile(obs([], None, num_spares=2)) if a.role == "spare"]  # not before
    acts = reconcile(obs(running(), status(), num_spares=2))
    assert acts == [Action("create", "spare", 0, 1), Action("create", "spare", 1, 1)]
    starting = [Proc("spare", 0, 1, "running", "sp0"), Proc("spare", 1, 1, "pending", "sp1")]
    assert reconcile(obs(running() + starting, status(), num_spares=2)) == []  # registered or not yet
    assert reconcile(obs(running() + starting, with_spares(status(), ("sp0", None)), num_spares=2)) == []


def test_a_lost_server_is_left_to_an_idle_spare_and_the_spare_is_adopted_then_replaced():
    spare = Proc("spare", 0, 1, "running", "sp0")
    procs = without(running(), "server", 1) + [spare]
    # The launcher saw the death before the coordinator: it reports it, and creates nothing for shard 1.
    acts = reconcile(obs(procs, with_spares(status(), ("sp0", None)), num_spares=1))
    assert acts == [Action("report_failed", "server", 1)]
    # Declared failed and assigned: still nothing. The assigned spare no longer counts as idle, but no new
    # spare starts while a shard is failed or recovering: a process start takes CPU the recovery needs.
    st = with_spares(status(shards={1: {"state": "failed"}}), ("sp0", 1))
    assert reconcile(obs(procs, st, num_spares=1)) == []
    # It registered as shard 1 (incarnation 2): adopted, and its recovery started like any replacement's.
    st = status(shards={1: {"state": "recovering", "incarnation": 2, "instance": "sp0"}})
    acts = reconcile(obs(procs, with_spares(st, ("sp0", 1)), num_spares=1))
    assert acts == [Action("adopt", "server", 1, 2, instance="sp0"), Action("start_recovery", "server", 1)]
    # Recovered: a new spare is started in its place (a replacement: counted against the backoff limit).
    st = with_spares(status(shards={1: {"state": "up", "incarnation": 2, "instance": "sp0"}}), ("sp0", 1))
    acts = reconcile(obs(procs, st, num_spares=1))
    assert acts == [
        Action("adopt", "server", 1, 2, instance="sp0"),
        Action("create", "spare", 1, 1, replacement=True),
    ]
    assert reconcile(obs(procs, st, num_spares=1, replacements=3, backoff_limit=3))[-1].kind == "fail"
    # As the launchers observe it once relabelled (a server that was spare 0): the new spare is still spare 1,
    # never 0 again (a pod's name carries the index).
    adopted = without(procs, "spare", 0) + [Proc("server", 1, 2, "running", "sp0", spare=0)]
    assert reconcile(obs(adopted, st, num_spares=1)) == [Action("create", "spare", 1, 1, replacement=True)]
    # Once it is there (registered or still starting), nothing more.
    assert reconcile(
        obs(procs + [Proc("spare", 1, 1, "running", "sp1")], with_spares(st, ("sp1", None)), num_spares=1)
    ) == [Action("adopt", "server", 1, 2, instance="sp0")]


def test_replacements_seen_from_the_pods_never_count_an_adoption():
    # The operator's lower bound when its status lags the pods. A CI run counted 2 for one server lost to a
    # spare: the adoption bumped shard 1's incarnation (no pod created) and the new spare was counted too.
    base = running()
    assert replacements_seen(base, 0) == 0
    assert replacements_seen(without(base, "server", 1) + [Proc("server", 1, 2, "running")], 0) == 1
    adopted = without(base, "server", 1) + [Proc("server", 1, 2, "running", "sp0", spare=0)]
    assert replacements_seen(adopted, 1) == 0  # taken over, no spare started yet
    assert replacements_seen(adopted + [Proc("spare", 1, 1, "pending", "sp1")], 1) == 1  # the new spare
    # The adopted pod deleted in turn, a pod of the shard's own created, spare 1 still idle: two.
    again = without(base, "server", 1) + [
        Proc("server", 1, 3, "running"),
        Proc("spare", 1, 1, "running", "sp1"),
    ]
    assert replacements_seen(again, 1) == 2
    # Spares that never took over count as adoptions at most, never as more: an idle spare that died and was
    # replaced is one replacement, the dead one still visible.
    assert replacements_seen(base + [Proc("spare", 0, 1, "failed"), Proc("spare", 1, 1, "running")], 1) == 1
    assert replacements_seen(base + [Proc("coordinator", 0, 3, "running")], 0) == 2


def test_without_an_idle_spare_a_lost_server_gets_its_own_replacement():
    procs = without(without(running(), "server", 1), "server", 2) + [Proc("spare", 0, 1, "running", "sp0")]
    st = with_spares(status(shards={1: {"state": "failed"}, 2: {"state": "failed"}}), ("sp0", None))
    acts = reconcile(obs(procs, st, num_spares=1))
    # One spare for two lost shards: shard 1 waits for it, shard 2 gets a process of its own.
    assert Action("create", "server", 2, 2, replacement=True) in acts
    assert not [a for a in acts if a.kind == "create" and a.role == "server" and a.index == 1]
    # A dead spare is no spare: both get their own; a new spare waits until they are rebuilt.
    dead = [p for p in procs if p.role != "spare"] + [Proc("spare", 0, 1, "failed", "sp0", 137)]
    acts = reconcile(obs(dead, st, num_spares=1))
    assert {(a.role, a.index) for a in acts if a.kind == "create"} == {("server", 1), ("server", 2)}
    up = status(shards={1: {"incarnation": 2}, 2: {"incarnation": 2}})
    rebuilt = [p for p in running() if p.role != "server" or p.index not in (1, 2)] + [
        Proc("server", 1, 2, "running"),
        Proc("server", 2, 2, "running"),
        Proc("spare", 0, 1, "failed", "sp0", 137),
    ]
    acts = reconcile(obs(rebuilt, up, num_spares=1, replacements=2))
    assert [(a.kind, a.role, a.index) for a in acts] == [("create", "spare", 1)]
