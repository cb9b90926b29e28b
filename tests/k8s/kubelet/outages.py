"""Node loss: the stand-in for a node's machine dying (what `ecrec chaos --node` uses here), on node annotations.

A new value of the node annotation `chaos.ecrec.dev/node-down-id` with `chaos.ecrec.dev/node-down-seconds: S`
(positive, finite) kills the node's machine for S seconds. The id found when the kubelet registers the node
counts as seen, so a restarted kubelet does not die again. The node carries the label
`chaos.ecrec.dev/node-down-annotation=true` (node.py) to say it honours the annotations.

- **The node** (node.py's heartbeat loop, which reads its annotations about once a second): while down it
  patches no status and renews no Lease, so kube-controller-manager's node lifecycle controller marks it
  Unknown after its grace period (hack/kube-testenv: ECREC_KUBE_NODE_GRACE) and taints it
  `node.kubernetes.io/unreachable`, as for a real machine gone. When the time is up its heartbeat resumes at
  once; then `node_up`.
- **Its pods** (`node_down`): every pod worker of the node crashes (lifecycle.py's `crash`): its process groups
  SIGKILLed at once, and nothing written, ever: a dead machine reports nothing, so the pod objects stay as the
  API had them (phase Running). Pod events and relists for the node are ignored while it is down (kubelet.py):
  nothing starts there.
- **Back up** (`node_up`): the pods bound to the node are listed. One that was admitted there when the machine
  died (its uid is remembered) and is not terminal gets what a kubelet coming back to no containers decides:
  restartPolicy Never (the job pods') ends Failed with reason NodeLost (`lost_status`); Always/OnFailure starts
  again (restartCount+1, as after a kubelet restart); one being deleted is removed. Every other pod bound there
  is handled as a relist does (started).

`KubeletOutages` is a mixin of `TestKubelet` (kubelet.py); its state is guarded by the kubelet's `_lock`.
`down_request` and `lost_status` are pure functions.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from kubernetes.client.exceptions import ApiException

from ecrec.chaos import NODE_DOWN_ID, NODE_DOWN_SECONDS

from .api import TERMINAL, now_iso

if TYPE_CHECKING:
    import logging
    import threading
    from collections.abc import Callable

    from .lifecycle import PodWorker

NODE_LOST = "NodeLost"  # the reason of a pod whose processes died with its node's machine


def down_request(annotations: dict[str, str] | None) -> tuple[float, str] | None:
    """(seconds, id) of a node's node-down annotations, if it has valid ones: an id and a positive, finite
    number of seconds."""
    ann = annotations or {}
    down_id, seconds = ann.get(NODE_DOWN_ID), ann.get(NODE_DOWN_SECONDS)
    try:
        s = float(seconds)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return (s, down_id) if down_id and math.isfinite(s) and s > 0 else None


def lost_status(pod: dict, node: str, now: str | None = None) -> dict:
    """The status (a merge patch of it) of a pod whose processes died with its node's machine and that does not
    restart: Failed, reason NodeLost; its running containers terminated with exit code 137 and reason
    ContainerStatusUnknown (nobody saw them exit); Ready and ContainersReady False."""
    now = now or now_iso()
    status = pod.get("status") or {}

    def container(cs: dict) -> dict:
        running = (cs.get("state") or {}).get("running")
        if running is None:
            return cs
        term = {
            "exitCode": 137,
            "reason": "ContainerStatusUnknown",
            "message": f"the process died with node {node}'s machine",
            "startedAt": running.get("startedAt"),
            "finishedAt": now,
            "containerID": cs.get("containerID"),
        }
        term = {k: v for k, v in term.items() if v is not None}
        return {**cs, "ready": False, "started": False, "state": {"terminated": term}}

    conds = []
    for c in status.get("conditions") or []:
        if c.get("type") in ("Ready", "ContainersReady"):
            old = c
            c = {k: v for k, v in c.items() if k != "message"}
            c.update(status="False", reason="PodCompleted")
            if old.get("status") != "False":
                c["lastTransitionTime"] = now
        conds.append(c)
    out: dict[str, Any] = {
        "phase": "Failed",
        "reason": NODE_LOST,
        "message": f"node {node} was lost: its machine died, and the pod's processes with it",
        "conditions": conds,
        "containerStatuses": [container(cs) for cs in status.get("containerStatuses") or []],
    }
    if status.get("initContainerStatuses"):
        out["initContainerStatuses"] = [container(cs) for cs in status["initContainerStatuses"]]
    return out


class KubeletOutages:
    """A node's machine dying and coming back, for the kubelet's side: its pods (a mixin of TestKubelet)."""

    # TestKubelet's, used here
    log: logging.Logger
    core: Any
    call: Callable[..., Any]
    _on_pod_event: Callable[[str, dict, str], None]
    _lock: threading.Lock
    _workers: dict[str, PodWorker]
    _worker_node: dict[str, str]
    _finished: set[str]
    # this mixin's, set in TestKubelet.__init__, guarded by _lock
    _down: set[str]  # the nodes whose machine is down
    _lost: dict[str, set[str]]  # node -> uids of the pods admitted there when its machine died, until node_up

    def node_down(self, node: str) -> None:
        """`node`'s machine died (called from its heartbeat thread): its pod workers crash; its pod events are
        ignored from now on."""
        with self._lock:
            self._down.add(node)
            workers = [w for uid, w in self._workers.items() if self._worker_node.get(uid) == node]
            self._lost.setdefault(node, set()).update(w.uid for w in workers)
        for w in workers:
            w.crash()
        self.log.warning(
            "node %s: machine down: %d pod(s) lost with it%s",
            node,
            len(workers),
            f" ({', '.join(w.key for w in workers)})" if workers else "",
        )

    def node_up(self, node: str) -> None:
        """`node`'s machine is back (called from its heartbeat thread; again on an exception until it returns):
        its lost pods get what a kubelet coming back to no containers decides, the others start."""
        with self._lock:
            self._down.discard(node)
            lost = set(self._lost.get(node, ()))
            crashed = [self._workers[uid] for uid in lost if uid in self._workers]
        for w in crashed:  # a crashed worker ends within a round; its uid then sits in _finished
            w.join(5)
            if w.is_alive():
                self.log.warning("%s: crashed worker still running after 5 s", w.key)
        selector = f"spec.nodeName={node}"
        pods = self.call(self.core.list_pod_for_all_namespaces, field_selector=selector)["items"]
        for pod in pods:
            uid = pod["metadata"]["uid"]
            if uid in lost:
                self._recover_lost(pod, node)
                with self._lock:
                    self._lost[node].discard(uid)
                continue
            with self._lock:
                known = uid in self._workers  # started by an event since: that is newer than this list
            if not known:
                self._on_pod_event("ADDED", pod, node)
        with self._lock:  # lost pods whose object went meanwhile: nothing to do
            self._lost.pop(node, None)
        self.log.info("node %s: back up: its pods handled (%d lost with the machine)", node, len(lost))

    def _recover_lost(self, pod: dict, node: str) -> None:
        meta = pod["metadata"]
        key, uid = f"{meta['namespace']}/{meta['name']}", meta["uid"]
        if ((pod.get("status") or {}).get("phase")) in TERMINAL:
            return
        try:
            if meta.get("deletionTimestamp"):  # nothing left to stop: the deletion completes
                self.call(
                    self.core.delete_namespaced_pod,
                    meta["name"],
                    meta["namespace"],
                    body={"gracePeriodSeconds": 0, "preconditions": {"uid": uid}},
                )
                self.log.info("%s: lost with node %s while being deleted: pod object removed", key, node)
            elif pod["spec"].get("restartPolicy", "Always") == "Never":
                self.call(
                    self.core.patch_namespaced_pod_status,
                    meta["name"],
                    meta["namespace"],
                    {"metadata": {"uid": uid}, "status": lost_status(pod, node)},
                    _content_type="application/merge-patch+json",
                )
                self.log.info("%s: lost with node %s: Failed (%s)", key, node, NODE_LOST)
            else:
                with self._lock:
                    self._finished.discard(uid)  # its crashed worker ended: a new one restarts it
                self._on_pod_event("ADDED", pod, node)
                self.log.info("%s: lost with node %s: restarted (restartPolicy Always/OnFailure)", key, node)
        except ApiException as e:
            if e.status not in (404, 409, 422):  # gone, or a new pod of that name: not ours
                raise
