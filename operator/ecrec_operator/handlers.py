"""kopf handlers: the thin adapter between the cluster and `ecrec.core.reconcile`.

- `pods_by_job` (an index) keeps the job's pods in memory, from the pods' own watch stream.
- `server_pod_event` reacts at once when a server pod is deleted or fails: it tells the coordinator, which
  probes and marks the shard failed, so training goes on in degraded mode without waiting for heartbeats.
- `reconcile_job` (a timer on each ECRecJob) observes the pods and the coordinator's `/v1/status`, asks the
  pure reconciler what to do, does it (create or delete pods, call the coordinator) and writes the status;
  a suspended job's pods it deletes instead (`suspend`), and it reports servers that share a failure domain
  (`domains`, the condition FailureDomainsAtRisk).

All state lives in the cluster (pods, their labels, the job's status) and in the coordinator, never in this
process: a restarted operator carries on from what it observes. Pods carry no kopf finalizers (only the
event handler and the index watch them); the job gets kopf's finalizer because of the timer.
"""

from __future__ import annotations

import base64
import concurrent.futures
import datetime
import logging
import threading
import time
from collections.abc import Callable

import httpx
import kopf
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from ecrec import auth
from ecrec.coordinator.client import CoordinatorClient
from ecrec.coordinator.contract import WorkerLost
from ecrec.core.reconcile import Action, Observed, coordinator_seed, reconcile, replacements_seen
from ecrec.data import check_data
from ecrec.jobctx import JobContext
from ecrec.spec import SpecError, job_from_spec

from . import domains, metrics, nodes, pinning, render, suspend
from .status import job_status, set_condition

log = logging.getLogger("ecrec_operator")
HTTP_TIMEOUT = 3.0
# (ns, job, shard) -> when the operator saw the shard's registered server lost, and that server's instance
_lost_at: dict[tuple[str, str, int], tuple[float, str]] = {}
# (ns, job) -> shard -> the instance registered for it in the coordinator's status the operator read last
_registered: dict[tuple[str, str], dict[int, str]] = {}
_lock = threading.Lock()


def _shards(coord_status: dict | None) -> dict[int, dict]:
    return {int(s["shard"]): s for s in ((coord_status or {}).get("cluster") or {}).get("shards", [])}


def _recoveries_started(owner, namespace: str, job: str, coord_status: dict | None) -> None:
    """RecoveryStarted for each lost server whose shard has another process registered since: the coordinator
    starts a replacement's rebuild when it registers, so the operator sees it started (or already done)."""
    shards = _shards(coord_status)
    with _lock:
        started = []
        for key in [k for k in _lost_at if k[:2] == (namespace, job)]:
            s = shards.get(key[2]) or {}
            if s.get("state") in ("recovering", "up") and s.get("instance") not in ("", _lost_at[key][1]):
                started.append((key[2], s["instance"], _lost_at.pop(key)[0]))
    for shard, instance, lost in started:
        kopf.info(owner, reason="RecoveryStarted", message=f"server {shard}: {instance} is being rebuilt")
        metrics.replacement_seconds.observe(time.time() - lost)


# -- observation -------------------------------------------------------------------------------------------
@kopf.index("", "v1", "pods", labels={render.LABEL_JOB: kopf.PRESENT})
def pods_by_job(namespace, name, labels, meta, spec, status, **_):
    """(namespace, job) -> the pod's name, labels, deletion mark, node and status, as plain data."""
    return {
        (namespace, labels[render.LABEL_JOB]): {
            "metadata": {
                "name": name,
                "labels": dict(labels),
                "deletionTimestamp": meta.get("deletionTimestamp"),
            },
            "spec": {"nodeName": (spec or {}).get("nodeName")},
            "status": {
                "phase": status.get("phase", "Pending"),
                "podIP": status.get("podIP"),
                "containerStatuses": list(status.get("containerStatuses") or []),
            },
        }
    }


def _pods(index, namespace: str, job: str) -> list[dict]:
    return list(index.get((namespace, job), []))


def _coordinator_base(pods: list[dict]) -> str | None:
    """The coordinator's REST base URL, by its pod IP (reachable in-cluster and from the test harness)."""
    best = None
    for p in pods:
        lab = p["metadata"]["labels"]
        if lab.get(render.LABEL_ROLE) != "coordinator" or p["metadata"].get("deletionTimestamp"):
            continue
        if p["status"].get("phase") == "Running" and p["status"].get("podIP"):
            if best is None or int(lab.get(render.LABEL_INCARNATION, 1)) > best[0]:
                best = (int(lab.get(render.LABEL_INCARNATION, 1)), p["status"]["podIP"])
    return f"http://{best[1]}:{render.HTTP_PORT}" if best else None


def _get_status(base: str | None) -> dict | None:
    if base is None:
        return None
    try:
        with CoordinatorClient(base, timeout=HTTP_TIMEOUT) as coordinator:
            return coordinator.status()
    except (httpx.HTTPError, ValueError):
        return None


# -- the job token ------------------------------------------------------------------------------------------
_tokens: dict[tuple[str, str, str], str] = {}  # (namespace, job, job uid) -> token, as read from its Secret


def _job_token(namespace: str, job: str, uid: str) -> str:
    """The job's token, read from its Secret (ApiException 404 if it has none yet). The cluster is the truth:
    a restarted operator reads the same token back; a job deleted and created again under its name is
    another uid, with another Secret."""
    key = (namespace, job, uid)
    with _lock:
        if key in _tokens:
            return _tokens[key]
    secret = k8s.CoreV1Api().read_namespaced_secret(render.token_secret_name(job), namespace)
    token = base64.b64decode((secret.data or {})["token"]).decode()
    with _lock:
        _tokens[key] = token
    return token


def _ensure_token(job, namespace: str, owner) -> str:
    """The job's token, creating its Secret (owned by the job, so it goes with it) on the first pass."""
    uid = owner["metadata"]["uid"]
    try:
        return _job_token(namespace, job.name, uid)
    except ApiException as e:
        if e.status != 404:
            raise
    secret = render.token_secret(job, namespace, auth.new_token())
    kopf.adopt(secret, owner=owner)
    try:
        k8s.CoreV1Api().create_namespaced_secret(namespace, secret)
    except ApiException as e:
        if e.status != 409:  # created by an earlier pass that died before caching it: read it back
            raise
    return _job_token(namespace, job.name, uid)


def _post(base: str, token: str | None, call: Callable[[CoordinatorClient], dict]) -> dict | None:
    """One write to the coordinator at `base` (`call` on a client made for it: passes are a second apart). Its
    answer, or None for an error status (refused, malformed: the next pass decides again); httpx.TransportError
    when no coordinator answers."""
    with CoordinatorClient(base, token=token, timeout=HTTP_TIMEOUT) as coordinator:
        try:
            return call(coordinator)
        except httpx.HTTPStatusError:
            return None


# -- reacting at once to a lost server --------------------------------------------------------------------
_reported: set[tuple[str, str]] = set()  # (namespace, pod) whose loss was announced


@kopf.on.event("", "v1", "pods", labels={render.LABEL_ROLE: "server"})
def server_pod_event(
    event, name, namespace, labels, meta, status, pods_by_job: kopf.Index, suspended_jobs: kopf.Index, **_
):
    gone = event.get("type") == "DELETED" or meta.get("deletionTimestamp") or status.get("phase") == "Failed"
    if not gone:
        return
    job, shard = labels.get(render.LABEL_JOB), int(labels.get(render.LABEL_SHARD, -1))
    if suspend.is_suspended(suspended_jobs, namespace, job):
        return  # deleted by the suspend itself: no failure to report
    base = _coordinator_base(_pods(pods_by_job, namespace, job))
    if base is None or shard < 0:
        return
    with _lock:
        if _registered.get((namespace, job), {}).get(shard) == name:  # (not a superseded process)
            _lost_at.setdefault((namespace, job, shard), (time.time(), name))
        first = (namespace, name) not in _reported
        _reported.add((namespace, name))
    owner = next((o for o in meta.get("ownerReferences") or [] if o.get("kind") == "ECRecJob"), None)
    if first and owner is not None:
        job_ref = {
            "apiVersion": owner["apiVersion"],
            "kind": owner["kind"],
            "metadata": {"name": owner["name"], "namespace": namespace, "uid": owner["uid"]},
        }
        kopf.warn(job_ref, reason="ServerLost", message=f"server {shard}: pod {name} is gone; reporting it")
    try:  # the coordinator probes the address before it believes us: a spurious report changes nothing
        token = _job_token(namespace, job, owner["uid"]) if owner is not None else None
        _post(base, token, lambda c: c.report_failure(shard, "operator"))
    except (httpx.HTTPError, ApiException) as e:
        log.info("could not report shard %d of %s/%s: %s", shard, namespace, job, e)


# -- the reconcile loop ----------------------------------------------------------------------------------
# backoff: a pass that raised is retried after 2 s, not kopf's default 60 s (a job's status and its
# replacements would stand still for a minute).
@kopf.timer(render.GROUP, render.VERSION, render.PLURAL, interval=1.0, initial_delay=0.0, backoff=2.0)
def reconcile_job(name, namespace, spec, status, meta, body, patch, pods_by_job: kopf.Index, logger, **_):
    metrics.reconciles.inc()
    now = datetime.datetime.now(datetime.UTC)
    phase = status.get("phase")
    if phase == "Failed" or (phase == "Succeeded" and status.get("completionTime")):
        _finish(name, namespace, spec, status, body, pods_by_job, now)
        return
    pinned = (meta.get("annotations") or {}).get(pinning.ANNOTATION)
    if pinned is None:
        try:
            job = job_from_spec(name, spec)
        except SpecError as e:
            # A spec the schema could not reject (cross-field rules): nothing is created.
            _fail(patch, body, status, now, "ECRecJobInvalidSpec", f"invalid spec: {e}")
            return
        problems = render.kubernetes_problems(job)
        if problems:
            _fail(patch, body, status, now, "ECRecJobInvalidSpec", "invalid spec: " + "; ".join(problems))
            return
        if job.spec.run_policy.suspend:  # created suspended: nothing is pinned until it first starts
            suspend.suspend(k8s.CoreV1Api(), namespace, name, [], status, body, patch, now)
            return
        try:
            pinned = _pin(namespace, name, job)  # before the first pod: every pod is rendered from it
        except ApiException as e:
            logger.warning("pinning the spec: %s", e)
            return
    resolved = pinning.resolve(name, spec, pinned)
    job = resolved.job
    pods = _pods(pods_by_job, namespace, name)
    if job.spec.run_policy.suspend:
        suspend.suspend(k8s.CoreV1Api(), namespace, name, pods, status, body, patch, now)
        return
    if status.get("phase") == "Suspended":
        suspend.resume(k8s.CustomObjectsApi(), namespace, name, pods, status, body, patch, now)
        return
    pods = _release_lost_nodes(body, namespace, pods, logger)
    if not pods and not status.get("coordinatorIncarnation"):
        # Before anything starts: data files that are missing or malformed fail here with one line, not as
        # a worker's traceback once every pod runs (the operator reads the data too, for the final checks).
        problems = check_data(job.spec)
        if problems:
            _fail(patch, body, status, now, "ECRecJobInvalidData", "; ".join(problems))
            return
    procs = tuple(p for p in (render.observe_pod(pod) for pod in pods) if p is not None)
    try:
        token = _ensure_token(job, namespace, body)
    except ApiException as e:
        logger.warning("the job token: %s", e)
        return  # nothing can be created or told without it: the next pass tries again
    coord_status = _get_status(_coordinator_base(pods))
    if coord_status is not None:
        registered = {i: s.get("instance", "") for i, s in _shards(coord_status).items()}
        with _lock:
            _registered[(namespace, name)] = registered
    run_policy = job.spec.run_policy
    # Replacements so far: what the status says, or what the pods show if more (an operator killed between
    # creating a replacement and writing the status).
    replacements = max(
        int(status.get("replacements") or 0), replacements_seen(procs, job.spec.servers.spares)
    )
    started = status.get("startTime")
    if run_policy.active_deadline_seconds and started:
        age = (now - _parse_time(started)).total_seconds()
        if age > run_policy.active_deadline_seconds:
            _fail(
                patch,
                body,
                status,
                now,
                "DeadlineExceeded",
                f"active for {age:.0f}s, over activeDeadlineSeconds",
            )
            return
    obs = Observed(
        num_servers=job.spec.servers.replicas,
        num_workers=job.spec.workers.replicas,
        procs=procs,
        status=coord_status,
        deleting=bool(meta.get("deletionTimestamp")),
        replacements=replacements,
        backoff_limit=run_policy.backoff_limit,
        recoverable=job.spec.fault_tolerance.strategy != "none",
        num_spares=job.spec.servers.spares,
        # After training, servers are kept whole until the final checks have run (then cleanPodPolicy).
        settle_after_finish=True,
        coordinator_incarnation=max(
            [
                int(status.get("coordinatorIncarnation") or 0),
                int((status.get("resume") or {}).get("generation") or 0),
                *(p.incarnation for p in procs if p.role == "coordinator"),
            ]
        ),
    )
    created_replacements = 0
    coordinator_created = None
    base = _coordinator_base(pods)
    for action in reconcile(obs):
        metrics.actions.labels(action.kind).inc()
        if action.kind == "fail":
            reason = "BackoffLimitExceeded" if "backoffLimit" in action.reason else "ECRecJobFailed"
            _fail(patch, body, status, now, reason, action.reason)
            return
        try:
            created_replacements += _act(action, job, namespace, body, base, logger, status, procs, token)
            if action.kind == "create" and action.role == "coordinator":
                coordinator_created = action.incarnation
        except (ApiException, httpx.HTTPError) as e:
            metrics.errors.labels(action.kind).inc()
            logger.warning("%s %s %d: %s", action.kind, action.role, action.index, e)
    _recoveries_started(body, namespace, name, coord_status)
    # Training over (the coordinator says Succeeded): the job is Checking until the final checks have passed,
    # then Succeeded, their results and completionTime go out in one status write (Kubeflow's "complete").
    final = None
    seen = coord_status
    if coord_status is not None and coord_status.get("phase") == "Succeeded":
        final = _final_checks.poll(
            (namespace, name, meta.get("uid")), JobContext(job, token=token), coord_status, base, logger
        )
        if final is None:
            seen = {**coord_status, "phase": "Checking"}
    new = job_status(job.spec, seen, procs, status, now, replacements=replacements + created_replacements)
    if final is not None:
        new.update(final)
        new["completionTime"] = _iso(now)
    if coordinator_created is not None:
        new["coordinatorIncarnation"] = coordinator_created
    new["conditions"] = _spec_condition(body, new.get("conditions") or [], resolved, now)
    new["conditions"] = _domain_condition(body, new["conditions"], job.spec, pods, now)
    if meta.get("generation") is not None:
        new["observedGeneration"] = int(meta["generation"])  # the spec this pass saw (edits: see pinning)
    for key, value in new.items():
        if status.get(key) != value:  # an unchanged field is not sent again (status.resume can be large)
            patch.status[key] = value
    _announce_transition(body, status.get("phase"), new.get("phase"), new.get("reason"))


def _act(action: Action, job, namespace: str, owner, base: str | None, logger, status, procs, token) -> int:
    """Carry out one action; returns 1 for a replacement pod created (counted against backoffLimit)."""
    core = k8s.CoreV1Api()
    if action.kind == "create":
        resume = None
        if action.role == "coordinator" and action.replacement:
            # Its predecessor's state as this operator last wrote it into the job's status.
            resume = coordinator_seed(status.get("resume"), procs, action.incarnation)
        if action.role == "coordinator":
            svc = render.coordinator_service(job, namespace)
            kopf.adopt(svc, owner=owner)
            try:
                core.create_namespaced_service(namespace, svc)
            except ApiException as e:
                if e.status != 409:
                    raise
            policy = render.network_policy(job, namespace)  # None unless the chart's --config turns it on
            if policy is not None:
                kopf.adopt(policy, owner=owner)
                try:
                    k8s.NetworkingV1Api().create_namespaced_network_policy(namespace, policy)
                except ApiException as e:
                    if e.status != 409:
                        raise
        pod = render.pod(
            job, namespace, action.role, action.index, action.incarnation, action.replacement, resume=resume
        )
        kopf.adopt(pod, owner=owner)
        try:
            core.create_namespaced_pod(namespace, pod)
        except ApiException as e:
            if e.status == 409:
                return 0  # created by an earlier pass whose watch event has not arrived yet
            kopf.warn(owner, reason="FailedCreatePod", message=f"{pod['metadata']['name']}: {e.reason}")
            raise
        kopf.info(owner, reason="SuccessfulCreatePod", message=f"Created pod: {pod['metadata']['name']}")
        metrics.pods_created.labels(action.role, str(action.replacement).lower()).inc()
        if action.replacement:
            kopf.info(
                owner,
                reason="ReplacementCreated",
                message=f"{action.role} {action.index}: replacement pod {pod['metadata']['name']}",
            )
        # (a spare started in place of one that took over a shard is a replacement too)
        return 1 if action.incarnation > 1 or (action.role == "spare" and action.replacement) else 0
    if action.kind == "adopt":
        # A warm spare registered as a failed shard: from now on it is that shard's server pod (the labels
        # are what this operator, `ecrec chaos` and kubectl select by).
        core.patch_namespaced_pod(
            action.instance,
            namespace,
            {"metadata": {"labels": render.labels(job.name, "server", action.index, action.incarnation)}},
        )
        kopf.info(
            owner,
            reason="SpareTookOver",
            message=f"server {action.index}: spare pod {action.instance} took over (incarnation {action.incarnation})",
        )
        metrics.pods_created.labels("server", "true").inc()
        return 0
    if action.kind == "delete":
        pod_name = action.instance
        try:
            core.delete_namespaced_pod(pod_name, namespace)
        except ApiException as e:
            if e.status != 404:
                raise
        kopf.info(owner, reason="SuccessfulDeletePod", message=f"Deleted pod {pod_name}: {action.reason}")
        return 0
    if base is None:
        return 0  # the coordinator does not answer yet: the next pass does it
    if action.kind == "report_failed":
        with _lock:
            instance = _registered.get((namespace, job.name), {}).get(action.index)
            if instance:
                _lost_at.setdefault((namespace, job.name, action.index), (time.time(), instance))
        _post(base, token, lambda c: c.report_failure(action.index, "operator"))
        kopf.warn(owner, reason="ServerLost", message=f"server {action.index}: its pod is gone")
    elif action.kind == "start_recovery":
        if _post(base, token, lambda c: c.start_recovery(action.index)) is not None:
            kopf.info(
                owner,
                reason="RecoveryStarted",
                message=f"server {action.index}: lock-by-lock recovery started",
            )
            with _lock:
                lost = _lost_at.pop((namespace, job.name, action.index), None)
            if lost is not None:
                metrics.replacement_seconds.observe(time.time() - lost[0])
    elif action.kind == "report_worker_lost":
        req = WorkerLost(rank=action.index, instance=action.instance, replacing=True, reason=action.reason)
        _post(base, token, lambda c: c.worker_lost(req))
        kopf.warn(owner, reason="WorkerLost", message=f"worker {action.index}: its pod is gone; replacing it")
    elif action.kind == "report_worker_finished":
        _post(base, token, lambda c: c.worker_finished(action.index, action.instance))
    return 0


class FinalChecks:
    """After training: evaluation on the held-out split and the parity check (I1), once every shard is up and
    no recovery is running. They take seconds (a pass over the eval split, every stripe read), so they run on a
    thread of their own and the timer only polls: one job's checks never hold up the reconcile of another.
    Nothing here needs to survive a restart: a restarted operator simply runs them again."""

    def __init__(self, workers: int = 2):
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="final-checks")
        self._running: dict[tuple, concurrent.futures.Future] = {}
        self._lock = threading.Lock()

    def poll(self, key: tuple, ctx, coord_status: dict | None, base: str | None, logger) -> dict | None:
        """The checks' result once they have passed; None while they cannot run yet, run, or failed (then the
        next poll starts them again)."""
        if base is None or coord_status is None:
            return None
        shards = coord_status.get("cluster", {}).get("shards", [])
        if not shards or any(s.get("state") != "up" for s in shards):
            return None
        with self._lock:
            fut = self._running.get(key)
            if fut is None:
                self._running[key] = self._pool.submit(_run_final_checks, ctx, coord_status, logger)
                return None
            if not fut.done():
                return None
            del self._running[key]
        return fut.result()


def _run_final_checks(ctx, coord_status: dict, logger) -> dict | None:
    from ecrec import finalchecks
    from ecrec.client import PSClient

    client = PSClient(ctx, coord_status["cluster"])
    try:
        found = finalchecks.check(client)  # (the coordinator is not told the parity result: ecrec local's is)
        ev = found.eval
        out: dict = {"eval": {"auc": ev["auc"], "logloss": ev["logloss"]}}
        reference = finalchecks.reference(ctx.spec, found.data)  # real data: LR and FM on the same split
        if reference:
            out["eval"]["reference"] = reference
        if ctx.ecrec:
            pc = found.parity_check
            out["parityCheck"] = {
                "stripes": pc["stripes"],
                "mismatches": pc["mismatches"],
                "checkedAt": _iso(datetime.datetime.now(datetime.UTC)),
            }
        logger.info("final checks: %s", out)
        return out
    except Exception as e:  # noqa: BLE001 - a check that cannot run now runs on the next pass
        logger.warning("final checks failed, retrying: %s", e)
        return None
    finally:
        client.close()


_final_checks = FinalChecks()


def _iso(t: datetime.datetime) -> str:
    return t.isoformat().replace("+00:00", "Z")


def _parse_time(text: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))


def _pin(namespace: str, name: str, job) -> str:
    """The job's pinned spec (ecrec_operator.pinning): the one already written, which a pass that sees the job
    before its own annotation's watch event must not overwrite with a spec edited since, else this one."""
    api = k8s.CustomObjectsApi()
    obj = api.get_namespaced_custom_object(render.GROUP, render.VERSION, namespace, render.PLURAL, name)
    pinned = (obj["metadata"].get("annotations") or {}).get(pinning.ANNOTATION)
    if pinned is None:
        pinned = pinning.pin(job)
        # resourceVersion: a spec edited after the GET fails the patch (409), and the next pass starts over
        meta = {
            "annotations": {pinning.ANNOTATION: pinned},
            "resourceVersion": obj["metadata"]["resourceVersion"],
        }
        api.patch_namespaced_custom_object(
            render.GROUP, render.VERSION, namespace, render.PLURAL, name, {"metadata": meta}
        )
    return pinned


def _spec_condition(body, conditions: list[dict], resolved: pinning.Resolved, now) -> list[dict]:
    """SpecChangeIgnored: True, with what was not applied, while the live spec differs from the pinned one
    (an event when that starts or changes); False once it no longer does; absent if it never did."""
    message = resolved.message()
    old = next((c for c in conditions if c.get("type") == "SpecChangeIgnored"), None)
    if not message:
        if old is None or old.get("status") == "False":
            return conditions
        return set_condition(conditions, "SpecChangeIgnored", "False", "SpecUnchanged", "", _iso(now))
    if old is None or old.get("message") != message:
        kopf.warn(body, reason="SpecChangeIgnored", message=message)
    return set_condition(conditions, "SpecChangeIgnored", "True", "SpecChangeIgnored", message, _iso(now))


def _read_node(name: str) -> nodes.NodeInfo | None:
    try:
        node = k8s.CoreV1Api().read_node(name)
    except ApiException as e:
        if e.status == 404:
            return None
        log.warning("reading node %s: %s", name, e.reason)
        raise nodes.Unreadable(name) from e
    conditions = getattr(getattr(node, "status", None), "conditions", None) or []
    ready = next((c.status for c in conditions if c.type == "Ready"), None)
    return nodes.NodeInfo(dict(node.metadata.labels or {}), ready)


_nodes = nodes.NodeCache(_read_node)
_released: set[tuple[str, str]] = set()  # (namespace, pod) deleted for its lost node: one event each


def _release_lost_nodes(body, namespace: str, pods: list[dict], logger) -> list[dict]:
    """Deletes the job's pods on lost nodes with grace period 0 (nodes.py says why) and returns the others: the
    reconcile then sees them gone and replaces them (the scheduler no longer places pods on a lost node)."""
    lost = nodes.pods_on_lost_nodes(pods, _nodes.get(nodes.bound_nodes(pods)))
    if not lost:
        return pods
    core, released = k8s.CoreV1Api(), set()
    for pod, why in lost:
        name = pod["metadata"]["name"]
        try:
            core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
        except ApiException as e:
            if e.status != 404:
                logger.warning("deleting pod %s of a lost node: %s", name, e.reason)
                continue
        released.add(name)
        with _lock:
            first = (namespace, name) not in _released
            _released.add((namespace, name))
        if first:
            metrics.actions.labels("release_lost_node").inc()
            kopf.warn(body, reason=nodes.LOST_EVENT, message=f"pod {name}: {why}; deleted to be replaced")
    return [p for p in pods if p["metadata"]["name"] not in released]


def _domain_condition(body, conditions: list[dict], spec, pods: list[dict], now) -> list[dict]:
    """FailureDomainsAtRisk (strategy ecrec only): True, with a warning event naming the domains and their
    shards, while more than r servers share a failure domain; False once every shard is scheduled and none do."""
    if spec.fault_tolerance.strategy != "ecrec":
        return conditions
    key, r = spec.servers.failure_domain, spec.fault_tolerance.ecrec.r
    placement = domains.evaluate(pods, spec.servers.replicas, _nodes, key, r)
    if placement is None:
        return conditions
    message = placement.message(key, r)
    if not placement.at_risk:
        return set_condition(
            conditions, domains.CONDITION, "False", "FailureDomainsSpread", message, _iso(now)
        )
    old = next((c for c in conditions if c.get("type") == domains.CONDITION), None)
    if old is None or old.get("status") != "True" or old.get("message") != message:
        kopf.warn(body, reason=domains.CONDITION, message=message)
    return set_condition(conditions, domains.CONDITION, "True", domains.CONDITION, message, _iso(now))


def _fail(patch, body, status, now, reason: str, message: str) -> None:
    ts = _iso(now)
    patch.status["phase"] = "Failed"
    patch.status["reason"] = message
    patch.status["completionTime"] = status.get("completionTime") or ts
    patch.status["conditions"] = set_condition(
        status.get("conditions") or [], "Failed", "True", reason, message, ts
    )
    if status.get("phase") != "Failed":
        kopf.warn(body, reason=reason, message=message)


def _announce_transition(body, old: str | None, new: str | None, reason: str | None) -> None:
    if new == old or new is None:
        return
    if new == "Succeeded":
        kopf.info(body, reason="ECRecJobSucceeded", message="training finished and the final checks passed")
    elif new == "Checking":
        kopf.info(body, reason="ECRecJobChecking", message="training finished; running the final checks")
    elif new == "Failed":
        kopf.warn(body, reason="ECRecJobFailed", message=reason or "failed")
    elif new in ("Degraded", "Recovering"):
        kopf.info(body, reason=f"ECRecJob{new}", message=f"job is {new.lower()}")


def _delete_job(namespace: str, name: str, ttl: int) -> None:
    time.sleep(0.5)
    try:
        k8s.CustomObjectsApi().delete_namespaced_custom_object(
            render.GROUP, render.VERSION, namespace, render.PLURAL, name, propagation_policy="Background"
        )
        log.info("deleted %s/%s: ttlSecondsAfterFinished=%s passed", namespace, name, ttl)
    except ApiException as e:
        if e.status != 404:
            log.warning("could not delete %s/%s after its TTL: %s", namespace, name, e)


def _finish(name, namespace, spec, status, body, index, now: datetime.datetime) -> None:
    """A finished job: apply runPolicy.cleanPodPolicy (pods still running, or all), never recreate anything;
    delete the job itself once runPolicy.ttlSecondsAfterFinished has passed (its pods and Service go with it
    by their owner references)."""
    with _lock:
        _registered.pop((namespace, name), None)
    run_policy = spec.get("runPolicy") or {}
    ttl = run_policy.get("ttlSecondsAfterFinished")
    done_at = status.get("completionTime")
    if ttl is not None and done_at and (now - _parse_time(done_at)).total_seconds() >= ttl:
        # From a thread of its own, after this pass returns: deleted while its own timer runs, the job kept
        # kopf's finalizer for good (kopf 1.45 stopped the timer but never released the object).
        threading.Thread(target=_delete_job, args=(namespace, name, ttl), daemon=True).start()
        return
    policy = run_policy.get("cleanPodPolicy", "Running")
    if policy == "None":
        return
    core = k8s.CoreV1Api()
    for p in _pods(index, namespace, name):
        if p["metadata"].get("deletionTimestamp"):
            continue
        if policy == "All" or p["status"].get("phase") in ("Pending", "Running"):
            try:
                core.delete_namespaced_pod(p["metadata"]["name"], namespace)
            except ApiException as e:
                if e.status != 404:
                    raise
