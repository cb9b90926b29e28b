"""What to do about a job's processes: one pure reconciler for both launchers (no I/O).

The Kubernetes operator observes pods, the local launcher observes child processes; both observe the
coordinator's `/v1/status`. Each turns what it sees into `Observed` and carries out the `Action`s that
`reconcile` returns — creating and deleting pods or processes, telling the coordinator — so the two behave
alike and the behaviour is tested once (tests/test_reconcile.py).

A process is one incarnation of a role's index (server shard id, worker rank): a replacement is a new
process with the next incarnation, never a restart of the old one, and names carry the incarnation, so a
replacement never waits for an old process that is still terminating. Decisions depend only on what is
observed now, so they are idempotent under duplicate events and correct after the launcher restarts:
- a server shard with no live process is reported failed to the coordinator (at once, not after heartbeats
  time out) and gets a replacement, which starts empty and is rebuilt once it has registered;
- a server the coordinator declared failed while its process is still there (hung, paused) is deleted, and
  then replaced as above;
- a registered replacement gets its recovery started (the coordinator starts it itself at the registration;
  the request restarts one whose driver is gone, after a coordinator failover; it is refused before the
  replacement has registered and ignored while the rebuild runs);
- a worker whose process was killed or deleted before finishing its steps is reported lost and replaced
  under the same rank (it resumes where the coordinator's record of its progress ends); a worker that exited
  with an error of its own (exit code 1-127) fails the job with that reason instead;
- a worker whose process exited 0 (it exits only once a coordinator acknowledged its last report) while the
  coordinator's record says it is not done — a coordinator that died before its state was saved heard that
  report — is reported finished;
- a worker the coordinator declares unresponsive (silent for the failure timeout) whose process is still there
  is deleted; then, like any lost worker, it is reported lost and replaced under its rank;
- warm spares (`servers.spares`): that many spare processes are kept idle; a failed shard for which the
  coordinator has assigned a live spare, or which an idle one can still take, gets no new process of its
  own; a spare that registered as a shard is adopted as that shard's server (the launcher relabels it:
  role server, its shard id and incarnation) and a new spare is started in its place once no shard is failed
  or recovering (a process start takes CPU the recovery's training needs);
- a coordinator whose process is gone is replaced by the next incarnation, started from the launcher's last
  copy of its state (`coordinator_seed`); nothing else is decided until it answers;
- without a recoverable strategy a lost server fails the job;
- nothing is created once the job succeeded, failed or is being deleted (`settle_after_finish` lets the
  local launcher rebuild servers after training so its final checks see every shard whole); a process that
  finished its work is never recreated; more replacements than the job's backoff limit fail the job.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Role = Literal["coordinator", "server", "worker", "spare"]
ProcState = Literal["pending", "running", "succeeded", "failed", "deleting"]
LIVE: tuple[str, ...] = ("pending", "running")


@dataclass(frozen=True)
class Proc:
    """One observed pod or process."""

    role: Role
    index: int  # shard id (server), rank (worker), spare index (spare), 0 (coordinator)
    incarnation: int  # 1 for the first process of this role and index, +1 for each replacement
    state: ProcState
    instance: str = ""  # the id it registers with at the coordinator
    exit_code: int | None = None  # failed: its exit code (128 + n when killed by signal n), if known
    spare: int | None = None  # a server started as a warm spare: that spare's index (never reused)

    @property
    def live(self) -> bool:
        return self.state in LIVE


@dataclass(frozen=True)
class Observed:
    num_servers: int
    num_workers: int
    procs: tuple[Proc, ...]
    status: dict | None  # the coordinator's /v1/status; None while it does not answer
    deleting: bool = False  # the job is being deleted
    replacements: int = 0  # processes replaced so far (servers and workers)
    backoff_limit: int | None = None  # most replacements allowed; None = no limit
    recoverable: bool = True  # the strategy rebuilds a lost server (ecrec)
    settle_after_finish: bool = False  # keep servers whole (replace, rebuild) after training succeeded
    # The latest coordinator incarnation the launcher created (0: none yet). A pod, once deleted, is gone from
    # what is observed; this says a coordinator existed, so its successor must take over, not start afresh.
    coordinator_incarnation: int = 0
    num_spares: int = 0  # servers.spares


@dataclass(frozen=True)
class Action:
    kind: Literal[
        "create",
        "delete",
        "report_failed",
        "start_recovery",
        "report_worker_lost",
        "report_worker_finished",
        "fail",
        "adopt",
    ]
    role: Role | None = None
    index: int = 0
    incarnation: int = 0
    replacement: bool = False  # create: a server that starts empty, or a worker that resumes
    instance: str = ""  # delete / report_worker_lost / adopt: which process
    reason: str = ""


@dataclass
class _Plan:
    actions: list[Action] = field(default_factory=list)
    created: int = 0  # replacements among the creations


def reconcile(obs: Observed) -> list[Action]:
    """The actions that bring the observed processes to what the job needs now."""
    status = obs.status or {}
    phase = status.get("phase")
    if obs.deleting or phase == "Failed" or (phase == "Succeeded" and not obs.settle_after_finish):
        return []
    plan = _Plan()
    by = _group(obs.procs)
    coordinator = by.get(("coordinator", 0), [])
    if not coordinator and obs.coordinator_incarnation == 0:
        plan.actions.append(Action("create", "coordinator", 0, 1))
    elif not coordinator:  # lost, and its pod already removed
        plan.actions.append(
            Action("create", "coordinator", 0, obs.coordinator_incarnation + 1, replacement=True)
        )
        plan.created += 1
        return _within_backoff(obs, plan)
    elif not any(p.live for p in coordinator):
        last = coordinator[-1]
        if last.state == "failed" and last.exit_code and last.exit_code < 128:
            # It stopped itself (a bad seed, a port it cannot bind): another one would do the same.
            return [
                Action("fail", "coordinator", reason=f"the coordinator exited with code {last.exit_code}")
            ]
        # Training goes on without a coordinator (it is not on the data path); its successor rebuilds the
        # control state from the seed and the processes' heartbeats. What else to do waits for its answers.
        incarnation = _next(coordinator, obs.coordinator_incarnation)
        plan.actions.append(Action("create", "coordinator", 0, incarnation, replacement=True))
        plan.created += 1
        return _within_backoff(obs, plan)
    shards = {int(s["shard"]): s for s in status.get("cluster", {}).get("shards", [])}
    recoveries = _open_recoveries(status.get("recoveries", []))
    seen = obs.status is not None
    covered = _spares(plan, obs, by, shards, status, seen)
    for s in range(obs.num_servers):
        procs = by.get(("server", s), [])
        if not obs.recoverable and procs and not any(p.live for p in procs):
            return [
                Action(
                    "fail",
                    "server",
                    s,
                    reason=f"server {s} was lost and the job's strategy cannot rebuild it",
                )
            ]
        _server(plan, s, procs, shards.get(s), recoveries.get(s), seen, s in covered)
    if phase == "Succeeded":
        return plan.actions  # training is over: no worker is needed any more
    workers = {int(w["rank"]): w for w in status.get("workers", [])}
    for r in range(obs.num_workers):
        procs = by.get(("worker", r), [])
        errored = next((p for p in procs if p.state == "failed" and p.exit_code and p.exit_code < 128), None)
        if errored is not None and not any(p.live or p.state == "succeeded" for p in procs):
            return [Action("fail", "worker", r, reason=f"worker {r} exited with code {errored.exit_code}")]
        _worker(plan, r, procs, workers.get(r), seen)
    return _within_backoff(obs, plan)


def _within_backoff(obs: Observed, plan: _Plan) -> list[Action]:
    if obs.backoff_limit is not None and obs.replacements + plan.created > obs.backoff_limit:
        return [
            Action(
                "fail",
                reason=f"{obs.replacements + plan.created} replacements exceed runPolicy.backoffLimit "
                f"({obs.backoff_limit})",
            )
        ]
    return plan.actions


def coordinator_seed(resume: dict | None, procs: tuple[Proc, ...], incarnation: int) -> tuple[int, dict]:
    """(generation, seed) of a replacement coordinator: the dead one's last `resume` state as the launcher
    kept it, with the workers whose process finished marked done (their last report may not be in it). The
    generation is above the seed's, whatever the incarnation count says (pods of old incarnations may be
    gone)."""
    seed = dict(resume or {})
    finished = {p.index for p in procs if p.role == "worker" and p.state == "succeeded"}
    seed["workers"] = [
        {**w, "done": True} if int(w["rank"]) in finished and not w.get("lost") else dict(w)
        for w in seed.get("workers", [])
    ]
    return max(incarnation, int(seed.get("generation", 0)) + 1), seed


def replacements_seen(procs: tuple[Proc, ...] | list[Proc], num_spares: int) -> int:
    """Replacement pods the observed pods prove were created: a lower bound for the operator's count when its
    status lags the pods (an operator killed between creating a pod and writing the status).

    Each role and index's latest incarnation says how many times it was taken over; but a warm spare that
    takes over a shard bumps the shard's incarnation without a pod being created (the spare started in its
    place is the replacement). Adoptions are at most the spares started that are no longer spares, so
    subtracting that many never counts one too many — a count too high could fail a healthy job on
    runPolicy.backoffLimit; one too low (an idle spare deleted as well) lets one more replacement through."""
    latest: dict[tuple[str, int], int] = {}
    spares_seen, used = 0, []
    for p in procs:
        if p.role == "spare":
            spares_seen += 1
            used.append(p.index)
            continue
        latest[(p.role, p.index)] = max(latest.get((p.role, p.index), 1), p.incarnation)
        if p.spare is not None:
            used.append(p.spare)
    spares_started = max(used, default=-1) + 1  # spare indices are never reused
    bumps = sum(i - 1 for i in latest.values())
    adoptions_at_most = spares_started - spares_seen
    return max(0, bumps - adoptions_at_most + max(0, spares_started - num_spares))


def _group(procs) -> dict[tuple[str, int], list[Proc]]:
    out: dict[tuple[str, int], list[Proc]] = {}
    for p in procs:
        out.setdefault((p.role, p.index), []).append(p)
    for ps in out.values():
        ps.sort(key=lambda p: p.incarnation)
    return out


def _open_recoveries(records: list[dict]) -> dict[int, str]:
    """Shard -> state of its latest recovery record that is not completed."""
    out: dict[int, str] = {}
    for rec in records:
        if rec.get("state") != "completed":
            out[int(rec["shard"])] = rec.get("state", "")
    return out


def _next(procs: list[Proc], known: int = 0) -> int:
    return max([known, *(p.incarnation for p in procs)]) + 1


def _spares(plan: _Plan, obs: Observed, by: dict, shards: dict, status: dict, seen: bool) -> set[int]:
    """Adopt the spares that registered as a shard, keep `num_spares` idle ones, and return the failed shards
    a spare covers (assigned to it, or to be: an idle registered spare per failed shard)."""
    spares = [p for p in obs.procs if p.role == "spare"]
    if not spares and not obs.num_spares:
        return set()
    holders = {s.get("instance"): (i, int(s.get("incarnation", 0))) for i, s in shards.items()}
    pool = {sp["instance"]: sp.get("assigned") for sp in status.get("spares", [])}
    idle, covered = 0, set()
    for p in spares:
        if not p.live:
            continue
        if p.instance in holders:  # it registered as a shard: from now on that shard's server
            shard, incarnation = holders[p.instance]
            plan.actions.append(Action("adopt", "server", shard, incarnation, instance=p.instance))
            by.setdefault(("server", shard), []).append(
                Proc("server", shard, incarnation, p.state, p.instance, p.exit_code, spare=p.index)
            )
        elif pool.get(p.instance) is not None:
            covered.add(int(pool[p.instance]))
        elif p.instance in pool:
            idle += 1
    # Shards without a live process (failed, or about to be: the launcher may see a death first) and no
    # spare yet: the coordinator gives each an idle spare once it has declared it failed.
    lost = sorted(
        i
        for i, s in shards.items()
        if s.get("state") != "pending"
        and i not in covered
        and not any(p.live for p in by.get(("server", i), []))
    )
    covered.update(lost[:idle])
    # Spares to start: as many as are wanted and not already waiting (registered or still starting) — but not
    # while a shard is failed or being rebuilt: starting a process (Python and torch) takes seconds of CPU,
    # which on nodes shared with training comes out of the recovery's throughput; the spare is wanted for the
    # next failure, not this one.
    waiting = sum(1 for p in spares if p.live and p.instance not in holders and pool.get(p.instance) is None)
    recovering = any(s.get("state") in ("failed", "recovering") for s in shards.values())
    if seen and status.get("phase") not in ("Succeeded", "Failed") and not recovering:
        # past every spare index used, adopted ones too (a pod's name carries it: it must not come back)
        used = [p.index for p in spares] + [p.spare for p in obs.procs if p.spare is not None]
        nxt = max(used, default=-1) + 1
        for i in range(nxt, nxt + max(0, obs.num_spares - waiting)):
            plan.actions.append(Action("create", "spare", i, 1, replacement=i >= obs.num_spares))
            if i >= obs.num_spares:  # the initial spares are not replacements; the ones after are
                plan.created += 1
    return covered


def _server(
    plan: _Plan,
    s: int,
    procs: list[Proc],
    shard: dict | None,
    recovery: str | None,
    seen: bool,
    covered: bool = False,
):
    live = [p for p in procs if p.live]
    state = (shard or {}).get("state", "pending")
    registered = (shard or {}).get("instance", "")
    if not procs and state == "pending":
        plan.actions.append(Action("create", "server", s, 1))
        return
    if not live:
        if not seen:
            return  # what the coordinator knows decides whether this is a first start or a replacement
        if state in ("up", "recovering"):
            plan.actions.append(Action("report_failed", "server", s))
        if covered:
            return  # a warm spare takes it over
        # A shard that never registered has nothing to rebuild: its next process starts as a first one.
        first = state == "pending"
        incarnation = _next(procs, int((shard or {}).get("incarnation", 0)))
        plan.actions.append(Action("create", "server", s, incarnation, replacement=not first))
        plan.created += 1
        return
    holder = next((p for p in live if registered and p.instance == registered), None)
    if holder is not None:
        if state == "failed":  # declared dead while its process is still there: hung or paused
            plan.actions.append(
                Action(
                    "delete",
                    "server",
                    s,
                    holder.incarnation,
                    instance=holder.instance,
                    reason="the coordinator declared it failed",
                )
            )
        elif state == "recovering" and recovery not in ("waiting", "running"):
            plan.actions.append(Action("start_recovery", "server", s))
        for p in live:  # older processes of this shard are superseded: they can only get in the way
            if p.incarnation < holder.incarnation:
                plan.actions.append(
                    Action(
                        "delete",
                        "server",
                        s,
                        p.incarnation,
                        instance=p.instance,
                        reason=f"superseded by incarnation {holder.incarnation}",
                    )
                )


def _worker(plan: _Plan, r: int, procs: list[Proc], worker: dict | None, seen: bool):
    if not procs and worker is None:
        plan.actions.append(Action("create", "worker", r, 1))
        return
    if worker is not None and worker.get("unresponsive") and not worker.get("lost"):
        # declared unresponsive while its process is still there: hung or paused; once it is gone the
        # rules below report it lost and replace it
        for p in procs:
            if p.live and p.instance == worker.get("instance"):
                plan.actions.append(
                    Action(
                        "delete",
                        "worker",
                        r,
                        p.incarnation,
                        instance=p.instance,
                        reason="the coordinator declared it unresponsive",
                    )
                )
                return
    finished = [p for p in procs if p.state == "succeeded"]
    if worker is not None and not worker.get("done") and not worker.get("lost"):
        if any(p.instance == worker.get("instance") for p in finished):
            # It exited 0, so a coordinator heard its last report: one that died before its state was saved
            # (this coordinator started from an older copy). Tell this one.
            plan.actions.append(
                Action(
                    "report_worker_finished",
                    "worker",
                    r,
                    int(worker.get("incarnation", 0)),
                    instance=worker["instance"],
                )
            )
            return
    if any(p.live for p in procs) or finished:
        return  # running, or finished its steps: never recreated
    if not seen or (worker is not None and worker.get("done") and not worker.get("lost")):
        return
    known = int((worker or {}).get("incarnation", 0))
    if worker is not None and not worker.get("lost") and worker.get("instance"):
        gone = next((p for p in procs if p.instance == worker["instance"]), None)
        how = "gone" if gone is None or gone.exit_code is None else f"exited with code {gone.exit_code}"
        plan.actions.append(
            Action("report_worker_lost", "worker", r, known, instance=worker["instance"], reason=how)
        )
    plan.actions.append(Action("create", "worker", r, _next(procs, known), replacement=worker is not None))
    plan.created += 1
